"""One module per CLI command, each with `run(cfg, run_dir) -> int`; imported only when its command runs. The
list of commands and their help lines is qarl_cli.config.usage."""
