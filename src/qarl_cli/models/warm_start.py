"""Supervised warm start of a tiny model on generated arithmetic: teaches the answer format (\\boxed{N}) and
some arithmetic, and stops early on purpose, so that RL starts from a model that is right only sometimes and still
learning (by default its learning rate is not annealed: see TinyModelConfig.warm_start_final_lr)."""

from __future__ import annotations

import time
from typing import Callable

from qarl_cli.config.model import TinyModelConfig
from qarl_cli.data import arith
from qarl_cli.models.hf_eval import greedy_accuracy, prompt_ids, user_messages
from qarl_cli.models.tokenizer import BOXED
from qarl_cli.optim import MuonAdamW, lr_lambda


def _batch(tok, problems):
    import torch

    seqs, labels = [], []
    for ids, p in zip(prompt_ids(tok, user_messages(problems)), problems):
        resp = tok(f"{BOXED}{p.answer}}}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        seqs.append(ids + resp)
        labels.append([-100] * len(ids) + resp)  # loss on the response only
    width = max(map(len, seqs))
    pad = tok.pad_token_id
    return (torch.tensor([s + [pad] * (width - len(s)) for s in seqs]),
            torch.tensor([lab + [-100] * (width - len(lab)) for lab in labels]),
            torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs]))


def warm_start(model, tok, cfg: TinyModelConfig, log: Callable[[str], None]) -> dict:
    import torch
    from rich.progress import Progress

    torch.manual_seed(cfg.build_seed)
    # Level 1 twice as often: it is where the model first learns to read digits, which the others build on.
    stream = arith.train_stream(seed=cfg.build_seed, levels=[1, 1, 2, 3])
    # AdamW alone needs ~10x the steps here. The AdamW part at the full lr with betas (0.9, 0.98): the recipe the
    # default model was built with (qarl train's muon differs: AdamW part at lr / 5, betas from its config).
    opt = MuonAdamW(model, cfg.warm_start_lr, adamw_lr_ratio=1.0, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(max(1, cfg.warm_start_steps // 20), cfg.warm_start_steps,
                                                             "cosine", final=cfg.warm_start_final_lr))
    model.train()
    start, loss = time.time(), float("nan")
    with Progress(transient=True) as progress:
        task = progress.add_task("warm start", total=cfg.warm_start_steps)
        for _ in range(cfg.warm_start_steps):
            ids, labels, mask = _batch(tok, [next(stream) for _ in range(cfg.warm_start_batch)])
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss = out.loss.item()
            progress.update(task, advance=1, description=f"warm start (loss {loss:.3f})")
    seconds = time.time() - start
    acc = greedy_accuracy(model, tok, arith.test_split(500, [1, 2, 3]))
    log(f"[qarl] warm start: {cfg.warm_start_steps} steps in {seconds:.0f} s, final loss {loss:.3f}, "
        f"greedy test accuracy {acc['accuracy']:.1%}")
    return {"steps": cfg.warm_start_steps, "seconds": round(seconds, 1), "final_loss": loss, **acc}
