"""Every number of every schema has a declared domain (its DOMAINS table, qarl_cli.config.domains), and the
composed config enforces it: a value just past a bound fails in one line naming the key, the bound itself (when
closed) passes. The cases are generated from the tables, and a few are written out with their messages, so that
the tables are checked against what a user sees, not only against themselves."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from qarl_cli.cli import main
from qarl_cli.config.domains import check_domains, domains, numeric_fields
from qarl_cli.config.errors import ConfigError
from qarl_cli.config.registry import GROUPS, ROOTS, command_groups, conf_dir, register, validate
from qarl_cli.config.root import TrainConfig


def _schemas():
    """(command, group or None, option or None, schema) for every schema reachable from ROOTS and GROUPS."""
    for command, schema in ROOTS.items():
        yield command, None, None, schema
    for group, options in GROUPS.items():
        command = next(c for c in ROOTS if group in command_groups(c))
        for option, schema in options.items():
            yield command, group, option, schema


SCHEMAS = list(_schemas())


def test_every_number_of_every_schema_declares_its_domain():
    missing, stale = set(), set()
    for _, _, _, schema in SCHEMAS:
        numbers, table = numeric_fields(schema), domains(schema)
        missing |= {(schema.__name__, name) for name in numbers if name not in table}
        stale |= {(schema.__name__, name) for name in table if name not in numbers}
    assert not missing, f"numeric fields without a DOMAINS entry: {sorted(missing)}"
    assert not stale, f"DOMAINS entries that name no int or float field: {sorted(stale)}"


def _past(bound, integer, side):
    step = 1 if integer else 1e-3 * max(1.0, abs(bound))
    return bound - step if side == "lo" else bound + step


def _cases():
    """(command, overrides, key, value, refused, expected message) per bound of every bounded domain: just past
    it (refused) and, when closed, the bound itself (accepted). Options of one group sharing a field and its domain count once."""
    seen = set()
    for command, group, option, schema in SCHEMAS:
        table = domains(schema)
        for name, integer in numeric_fields(schema).items():
            domain = table.get(name)
            if domain is None or not domain.bounded or (group, name, repr(domain)) in seen:
                continue
            seen.add((group, name, repr(domain)))
            key = f"{group}.{name}" if group else name
            pick = [f"{group}={option}"] if group else []
            for side, bound, is_open in (("lo", domain.lo, domain.lo_open), ("hi", domain.hi, domain.hi_open)):
                if bound is None:
                    continue
                cast = int if integer else float
                past = cast(bound if is_open else _past(bound, integer, side))
                yield command, [*pick, f"{key}={past}"], key, past, True, f"{key}={past!r}: {domain.rule(integer)}"
                if not is_open:
                    yield (command, [*pick, f"{key}={cast(bound)}"], key, cast(bound), False,
                           f"{key}={cast(bound)!r}: {domain.rule(integer)}")
            if domain.zero:
                yield command, [*pick, f"{key}=0"], key, 0, False, f"{key}=0: {domain.rule(integer)}"


CASES = list(_cases())


@pytest.fixture(scope="module")
def hydra_ctx():
    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        yield
    GlobalHydra.instance().clear()


def _validate(command, overrides):
    cfg = compose(config_name=command, overrides=overrides)
    # Options such as model=hf or data=file need a path from the user: give one, then validate strictly.
    given = [f"{g}.path=/given" for g in command_groups(command) if OmegaConf.is_missing(cfg[g], "path")]
    given += [f"{k}=/given" for k in cfg if OmegaConf.is_missing(cfg, k)]  # qarl quantize's out
    return validate(compose(config_name=command, overrides=overrides + given), command)


def test_the_generated_cases_cover_every_bounded_domain():
    assert len({c[2] for c in CASES}) > 60 and any(c[2] == "rollout.base_port" for c in CASES)


@pytest.mark.parametrize("command,overrides,key,value,refused,expected", CASES,
                         ids=[f"{c[0]}-{c[1][-1]}" for c in CASES])
def test_a_value_past_a_bound_is_refused_and_the_bound_accepted(hydra_ctx, command, overrides, key, value, refused,
                                                                 expected):
    if refused:
        with pytest.raises(ConfigError) as err:
            _validate(command, overrides)
        assert str(err.value) == expected and "\n" not in expected
    else:
        try:
            _validate(command, overrides)
        except ConfigError as e:  # a rule relating it to another field (hidden_size = num_heads * head_dim)
            assert str(e) != expected, f"the bound itself is refused: {e}"


@pytest.mark.parametrize("args,message", [
    (["grad_clip=-1"], "grad_clip=-1.0: must be >= 0 (0: no clipping)"),
    (["weight_decay=-1"], "weight_decay=-1.0: must be >= 0 (0: no decay)"),
    (["rollout=vllm_server", "rollout.base_port=-5"],
     "rollout.base_port=-5: must be in 0..65535 (0: free ports chosen at start)"),
    (["rollout=vllm_server", "rollout.base_port=70000"],
     "rollout.base_port=70000: must be in 0..65535 (0: free ports chosen at start)"),
    (["rollout=vllm_server", "rollout.request_timeout_s=0"], "rollout.request_timeout_s=0.0: must be > 0 (seconds)"),
    (["reward.timeout_s=0"], "reward.timeout_s=0.0: must be > 0 (seconds)"),
    (["logger=wandb", "logger.log_samples=-1"], "logger.log_samples=-1: must be >= 0 (0: no samples table)"),
    (["data.test_size=0"], "data.test_size=0: must be >= 1 (the test split is evaluated, and used at start-up)"),
    (["algorithm.eps_neg_low=-0.1"], "algorithm.eps_neg_low=-0.1: must be in [0, 1) (the band's lower end 1 - eps "
                                     "is a ratio > 0)"),
    (["model.num_kv_heads=0"], "model.num_kv_heads=0: must be >= 1"),  # was a ZeroDivisionError in a validator
    (["prompts_per_step=0"], "prompts_per_step=0: must be >= 1"),  # before the rule relating it to minibatches
    (["reward.worker_memory_mb=100"], "reward.worker_memory_mb=100: must be 0 or >= 256 (0: unlimited)"),
])
def test_written_out_cases_fail_in_one_line(capsys, args, message):
    assert main(["train", *args, "--cfg", "job"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"qarl train: error: {message}", err


def test_eval_limit_and_every_bound_itself_pass(capsys):
    assert main(["eval", "limit=1", "samples=1", "temperature=0", "top_p=1", "--cfg", "job"]) == 0
    assert main(["eval", "limit=0", "--cfg", "job"]) == 2
    assert capsys.readouterr().err.strip().endswith("limit=0: must be >= 1 (null: every test problem)")
    assert main(["train", "rollout=vllm_server", "rollout.base_port=65535", "grad_clip=0", "--cfg", "job"]) == 0


def test_interpolations_and_none_are_not_numbers_to_check():
    cfg = TrainConfig()  # max_new_tokens is "${data.max_new_tokens}" until Hydra resolves it
    assert isinstance(cfg.max_new_tokens, str)
    check_domains(cfg)


def test_nan_and_inf_are_left_to_the_finite_check(capsys):
    assert main(["train", "grad_clip=-inf", "--cfg", "job"]) == 2
    assert capsys.readouterr().err.strip() == "qarl train: error: grad_clip=-inf: must be a finite number (not nan " \
                                              "or inf)"
