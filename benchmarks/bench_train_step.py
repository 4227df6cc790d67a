"""What one training step of ``scripts/train_eagle3.py`` costs, with the target run for the batch and with the
target's features kept (``--feature-cache-gib``, the trainer's default): the default model (or ``--model``) on
``--device``, a fresh EAGLE-3 head, ``--sequences`` random-token sequences of ``--seq-len`` tokens (a third of each
the prompt) in batches of ``--tokens-per-batch``. Per mode: the batch's inputs and labels (``batch_targets``: the
target's forward, or its kept rows, then its LM head), the head's training-time test with its backward and the
optimizer's step, their sum; the median of ``--steps`` steps after one warm-up step, the modes taking turns.

    python benchmarks/bench_train_step.py --device cuda --out result.json
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import random
import statistics
import time

from _common import commit, write_json

import torch


def load_trainer():
    """scripts/train_eagle3.py as a module."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "train_eagle3.py")
    spec = importlib.util.spec_from_file_location("train_eagle3", path)
    trainer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trainer)
    return trainer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args) -> dict:
    from dispatcher.llm import LLM
    from models.default_model import default_model_path

    trainer = load_trainer()
    device = torch.device(args.device)
    model = args.model or default_model_path()
    llm = LLM(model, device=args.device, max_num_seqs=8, max_model_len=args.seq_len + 16, kv_cache_memory_gib=1.0)
    target = llm.engine.worker.model
    vocab = target.cfg.vocab_size
    rng = random.Random(0)
    seqs = [([rng.randrange(3, vocab) for _ in range(args.seq_len)], args.seq_len // 3) for _ in range(args.sequences)]
    draft_ids = torch.arange(min(args.draft_vocab, vocab), device=device)
    head = trainer.build_head(target, draft_ids, device)
    in_draft = torch.zeros(vocab, dtype=torch.bool, device=device)
    in_draft[draft_ids] = True
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    aux_layers = head.shape.aux_layers
    cache = trainer.TargetFeatures(target, seqs, aux_layers, args.tokens_per_batch)
    batches = trainer.batches(seqs, args.tokens_per_batch, random.Random(1))
    times: dict[str, dict[str, list[float]]] = {m: {"inputs_s": [], "head_s": [], "step_s": []}
                                                for m in ("target_runs", "features_kept")}
    for i in range(1 + args.steps):
        batch = batches[i % len(batches)]
        for mode in times:
            sync(device)
            t0 = time.perf_counter()
            features = cache.rows(batch) if mode == "features_kept" else None
            inputs = trainer.batch_targets(target, [seqs[j] for j in batch], aux_layers, draft_ids, device,
                                           features)
            sync(device)
            t1 = time.perf_counter()
            loss, _ = trainer.ttt_loss(head, inputs, args.ttt, in_draft, draft_ids)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sync(device)
            t2 = time.perf_counter()
            if i:  # (the first step of each mode warms up)
                times[mode]["inputs_s"].append(t1 - t0)
                times[mode]["head_s"].append(t2 - t1)
                times[mode]["step_s"].append(t2 - t0)
    modes = {m: {k: round(statistics.median(v), 4) for k, v in parts.items()} for m, parts in times.items()}
    return {"benchmark": "train_step", "commit": commit(), "command": "python benchmarks/bench_train_step.py "
            + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out"),
            "model": os.path.basename(model), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
            else f"cpu ({os.cpu_count()} cores, {platform.machine()})", "torch": torch.__version__,
            "tokens_a_batch": [sum(len(seqs[j][0]) for j in b) for b in batches[:1 + args.steps]],
            "modes": modes,
            "speedup": round(modes["target_runs"]["step_s"] / modes["features_kept"]["step_s"], 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="the target (default: the default model)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--tokens-per-batch", type=int, default=32768)
    p.add_argument("--draft-vocab", type=int, default=4096)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="measured steps a mode (after one warm-up step)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    result = run(args)
    write_json(args.out, result)
    for mode, parts in result["modes"].items():
        print(f"{mode}: inputs {parts['inputs_s']:.3f} s + head {parts['head_s']:.3f} s = {parts['step_s']:.3f} s a "
              f"step")
    print(f"features kept: {result['speedup']:.2f}x the steps a second")


if __name__ == "__main__":
    main()
