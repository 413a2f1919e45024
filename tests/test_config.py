"""Every group option and every YAML under conf/ composes, and bad input fails at compose time with one line naming
the key."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from qarl_cli.config.registry import command_groups, conf_dir, options
from qarl_cli.cli import main
from qarl_cli.config.registry import GROUPS, ROOTS, register, validate

CONF = conf_dir()


def _variants():
    """(command, overrides, source) covering every group option (its schema) and every YAML file under conf/, each
    with a command that uses its group."""
    seen = set()
    for command in ROOTS:
        yield command, [], CONF / f"{command}.yaml"
        for group in command_groups(command):
            for option in options(group):
                if (group, option) not in seen:
                    seen.add((group, option))
                    yield command, [f"{group}={option}"], f"{group}/{option}"
    for option in options("experiment"):
        yield "train", [f"+experiment={option}"], CONF / "experiment" / f"{option}.yaml"


VARIANTS = list(_variants())


@pytest.fixture(scope="module")
def hydra_ctx():
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        yield
    GlobalHydra.instance().clear()


def test_every_yaml_under_conf_is_covered():
    every = {p.resolve() for p in Path(CONF).rglob("*.yaml")}
    covered = {path.resolve() for _, _, path in VARIANTS if isinstance(path, Path)}
    assert every == covered, f"YAML files no test composes: {sorted(map(str, every - covered))}"


@pytest.mark.parametrize("command,overrides,path", VARIANTS, ids=lambda v: str(v) if isinstance(v, list) else None)
def test_composes_and_validates(hydra_ctx, command, overrides, path):
    cfg = compose(config_name=command, overrides=overrides)
    # Options such as model=hf or data=gsm8k need a path from the user: give one, then validate strictly.
    required = [f"{g}.path=/given" for g in command_groups(command) if OmegaConf.is_missing(cfg[g], "path")]
    required += [f"{k}=/given" for k in cfg if OmegaConf.is_missing(cfg, k)]  # qarl quantize's out
    # Responses longer than the tiny default model's 256 positions (the file options' 1024 tokens) are refused
    # with it (config/engine_limits.py): such an option is composed with a model whose context holds them
    if "data" in cfg and cfg.data.max_new_tokens >= 256 and cfg.model.name.startswith("tiny"):
        required.append("model=smollm2_135m")
    cfg = compose(config_name=command, overrides=overrides + required)
    typed = validate(cfg, command)
    assert type(typed) is ROOTS[command]
    for group in command_groups(command):
        node = getattr(typed, group)
        assert node is None or type(node) is GROUPS[group][cfg[group].name]
    for override in overrides:
        group, _, option = override.lstrip("+").partition("=")
        if group in GROUPS:
            assert cfg[group].name == option  # the option is the schema of the same name


def test_group_options_match_their_schemas():
    for group, schemas in GROUPS.items():
        assert options(group) == sorted(schemas), group
        for option, schema in schemas.items():
            assert schema.name == option, (group, option)  # the name a run records is the name a user types
            assert ":" in schema.impl and schema.__doc__, (group, option)  # an implementation and a description


def test_every_option_resolves_to_its_implementation():
    """Each schema's impl imports (the registry names no missing module or attribute)."""
    from qarl_cli.stages import resolve

    for group, schemas in GROUPS.items():
        for option in schemas:
            assert callable(resolve(group, option)), (group, option)


def test_defaults_live_in_the_schema(hydra_ctx):
    """No YAML option file repeats a schema: group options are the schemas themselves; YAML is for presets."""
    for group in GROUPS:
        assert not list((CONF / group).glob("*.yaml")), group


def test_experiment_sets_the_paper_setting(hydra_ctx):
    cfg = compose(config_name="train", overrides=["+experiment=qwen3_30b_a3b_fp8"])
    assert cfg.quant.name == "fp8_block" and cfg.quant.block_size == [128, 128]
    assert cfg.algorithm.name == "tbpo" and cfg.model.name == "hf"
    assert OmegaConf.is_missing(cfg.model, "path")  # the user points it at a local checkpoint


@pytest.mark.parametrize("args,names", [
    (["quant=nope"], ["quant", "int8", "fp8_block", "w4a16", "none"]),
    (["-m", "quant=int8,nope"], ["quant", "nope"]),
    (["quant=w4a16", "quant.group_size=12"], ["quant.group_size", "12"]),
    (["quant=wna16", "quant.bits=5"], ["quant.bits", "5", "2, 3, 4, 8"]),
    (["quant=w4a16", "quant.bits=3"], ["quant.bits", "3", "quant=wna16 quant.bits=3"]),  # the 4-bit name, 3 bits
    (["rollout=vllm_server", "rollout.devices=[abc]"], ["rollout.devices", "'abc'", '"0-3"']),
    (["algorithm.eps_low=-1"], ["algorithm.eps_low"]),
    (["steps=abc"], ["steps", "abc"]),
    (["nokey=1"], ["nokey"]),
    (["model=hf", "steps=1"], ["model.path"]),  # without --cfg job: a missing required value is an error
    (["+experiment=nope"], ["experiment", "qwen3_30b_a3b_fp8"]),
    (["rollout=vllm", "rollout.gpu_memory_utilization=2"], ["rollout.gpu_memory_utilization"]),
    (["rollout=vllm", "rollout.sleep_between_steps=true", "rollout.max_staleness=1"],
     ["rollout.sleep_between_steps", "max_staleness=1"]),  # it would sleep while the next batch is generated
    (["rollout=vllm_server", "rollout.transfer_backend=rdma"], ["rollout.transfer_backend", "qarl_gloo", "nccl"]),
    (["rollout=vllm_server", "rollout.transfer_backend=qarl_gloo", "rollout.transfer_host=10.0.0.5"],
     ["rollout.transfer_host", "10.0.0.5", "api_key"]),  # the groups' secrets go over the keyed routes
    # a server's address needs http:// or https:// (one without a scheme got a message about qarl_shm; ftp passed)
    (["rollout=vllm_server", "rollout.urls=[127.0.0.1:8000]"], ["rollout.urls", "'127.0.0.1:8000'", "http://"]),
    (["rollout=vllm_server", "rollout.urls=[ftp://127.0.0.1:8000]"], ["rollout.urls", "'ftp://", "https://"]),
    (["rollout=vllm_server", "rollout.urls=[http://10.0.0.7:8000]", "rollout.api_key=k"],
     ["rollout.transfer_backend", "qarl_shm", "10.0.0.7", "qarl_gloo"]),  # files in this node's memory
    (["rollout=vllm_server", "rollout.transfer_backend=nccl", "sync.mode=online"],
     ["sync.mode", "nccl", "prequantized"]),  # vLLM's nccl engine loads as received: it cannot quantize
    (["betas=[0.9]"], ["betas", "[0.9]", "[beta1, beta2]"]),
    (["train_threads=-1"], ["train_threads", "-1"]),
    (["algorithm.name=ppo"], ["algorithm.name='ppo'", "algorithm=OPTION", "tbpo"]),  # the name is the option's
    # a key no schema declares, added with +, would be dropped without a word: refused, the closest key suggested
    (["+foo=1"], ["+foo=1: 'foo' is not a setting of qarl train"]),
    (["+rollout.bogus=2"], ["+rollout.bogus=2: 'rollout.bogus' is not a setting of rollout=vllm"]),
    (["+train_threadz=2"], ["'train_threadz' is not a setting of qarl train (did you mean train_threads?)"]),
    (["rollout=vllm_server", "++base_port=9000"], ["'base_port'", "did you mean rollout.base_port?"]),
    # the same key misspelt without + (Hydra's "Key 'lrr' not in 'TrainConfig'" named no key to use)
    (["lrr=1"], ["lrr=1: 'lrr' is not a setting of qarl train (did you mean lr?)"]),
    (["data.levls=[1]"], ["data.levls=[1]: 'data.levls' is not a setting of data=arith (did you mean data.levels?)"]),
])
def test_bad_input_fails_in_one_line(capsys, args, names):
    cfg_job = [] if "steps=1" in args else ["--cfg", "job"]
    assert main(["train", *args, *cfg_job]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for name in names:
        assert name in err, (name, err)


def test_presets_and_free_form_mappings_are_not_undeclared_keys(capsys):
    """+experiment=NAME selects a config group (nothing of its name stays in the config); a Dict field such as
    data.chat_template_kwargs takes any key."""
    assert main(["train", "+experiment=tiny_cot", "--cfg", "job"]) == 0
    assert main(["train", "+data.chat_template_kwargs.enable_thinking=false", "--cfg", "job"]) == 0
    assert main(["eval", "+lmit=3", "--cfg", "job"]) == 2
    assert capsys.readouterr().err.strip().endswith("'lmit' is not a setting of qarl eval (did you mean limit?)")


def test_serve_runs_a_vllm_server_only(capsys):
    assert main(["serve", "rollout=vllm", "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rollout='vllm'" in err and "rollout=vllm_server" in err, err


@pytest.mark.parametrize("args, key", [
    (["data.path=mine.jsonl"], "data.path='mine.jsonl'"),  # trained on arithmetic instead, exit 0
    (["data=arith_cot", "data.path=mine.jsonl"], "data.path='mine.jsonl'"),
    (["data.test_path=held.jsonl"], "data.test_path='held.jsonl'"),
    (["data.layout=gsm8k"], "data.layout='gsm8k'"),
])
def test_a_file_setting_on_generated_data_is_refused_not_ignored(capsys, args, key):
    from qarl_cli.cli import main

    assert main(["train", *args, "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qarl train: error: {key}: data=") and "data=file" in err[0], err


@pytest.mark.parametrize("args, refused, line", [
    (["data=file", "data.path={f}", "data.test_path={f}", "max_new_tokens=16"], ["data.test_size=5"],
     "data.test_size=5: not used by this run (the test split is data.test_path's problems"),
    (["eval_every=0"], ["eval_samples=2"], "eval_samples=2: not used by this run (eval_every=0 evaluates nothing"),
    ([], ["sync.verify_tolerance=0.1"], "sync.verify_tolerance=0.1: not used by this run (sync.verify_every=0 "
     "never verifies"),
], ids=["test_size-with-test_path", "eval_samples-without-eval", "tolerance-without-verify"])
def test_a_typed_value_the_run_would_not_use_is_refused(tmp_path, capsys, args, refused, line):
    """Each key acts once the value that turns it off is changed (the same command with it is accepted)."""
    f = tmp_path / "p.jsonl"
    f.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    args = [a.format(f=f) for a in args]
    assert main(["train", *args, *refused, "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"qarl train: error: {line}"), err
    acting = {"data.test_size=5": ["data.test_path=null"], "eval_samples=2": ["eval_every=5"],
              "sync.verify_tolerance=0.1": ["sync.verify_every=2"]}[refused[0]]
    assert main(["train", *args, *refused, *acting, "--cfg", "job"]) == 0
