"""Repetition control of the TensorRT-LLM path against RAS, measured on a CosyVoice2 LLM checkpoint (CPU).

    python -m enginebench.repetition_control --model-dir MODEL_DIR [--runs 40] [--text-tokens 12]

MODEL_DIR holds `llm.pt` and either the official `cosyvoice2.yaml` layout or a `harness_config.json` (the micro
parity model). The same prompt is decoded `--runs` times per policy, each run with its own seed:

* `ras`: our PyTorch path (speech_lm.sampling: nucleus top-k 25 / top-p 0.8, RAS window 10, tau_r 0.1);
* `topk_topp`: the TensorRT-LLM path without repetition control (nucleus only);
* `penalty`: nucleus after TensorRT-LLM's repetition penalty 1.1 (a logit of an id already in the sequence,
  prompt included, is divided by the penalty when positive and multiplied when negative);
* `penalty+guard`: the above with the orchestrator's loop guard (speech_serving.repetition) ending the
  utterance.

`--temperature` below 1 divides the logits for every policy: it turns the random-weight micro model, whose
distribution is nearly flat, into one that repeats itself, a stand-in for a trained model's loops.
EOS is masked before 2 x text tokens and a run stops at 20 x text tokens (upstream's limits). Printed per policy:
the share of steps whose token already occurs among the previous 10 tokens (what RAS suppresses), the share of
back-to-back repeats, the longest run of one token, tokens per run, and the share of runs that hit the length
limit. Full recompute per step (no KV cache): meant for small checkpoints.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from cosyvoice2.llm.model import CosyVoice2LM, LLMConfig
from cosyvoice2.llm.request import CosyVoice2Prefix, CosyVoice2Sampling
from speech_lm.sampling import make_generator, nucleus_sample, ras_sample
from speech_serving.repetition import LoopGuardConfig

TRTLLM_REPETITION_PENALTY = 1.1  # RenderOptions.repetition_penalty (upstream's value)


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """TensorRT-LLM's repetition penalty on 1-D `logits` for the ids in `seen` (each id once)."""
    out = logits.clone()
    values = out[seen]
    out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    return out


@dataclass
class Run:
    tokens: list[int]
    hit_limit: bool
    guard_cut: bool


def decode(
    lm: CosyVoice2LM,
    prefix: torch.Tensor,
    prompt_speech: list[int],
    min_len: int,
    max_len: int,
    policy: str,
    seed: int,
    temperature: float = 1.0,
) -> Run:
    config = lm.config
    generator = make_generator(seed, "cpu")
    params = CosyVoice2Sampling().params()  # CosyVoice2's RAS over its nucleus
    guard = LoopGuardConfig().start() if policy == "penalty+guard" else None
    tokens: list[int] = []
    embeds = prefix
    with torch.inference_mode():
        for step in range(max_len):
            logits = lm.llm_decoder(lm.hidden(embeds)[0, -1]).float() / temperature
            if step < min_len:
                logits[list(config.stop_ids)] = float("-inf")
            if policy.startswith("penalty"):
                seen = torch.tensor(sorted(set(prompt_speech) | set(tokens)), dtype=torch.long)
                logits = apply_repetition_penalty(logits, seen, TRTLLM_REPETITION_PENALTY)
            logp = torch.log_softmax(logits, dim=-1)
            if policy == "ras":
                token = ras_sample(logp, tokens, params, generator)
            else:
                token = nucleus_sample(logp, params.top_p, params.top_k, generator)
            if token in config.stop_ids:
                return Run(tokens, False, False)
            if guard is not None and guard.feed([token]) is not None:
                return Run(tokens, False, True)
            tokens.append(token)
            embeds = torch.cat([embeds, lm.embed_speech(torch.tensor([[token]]))], dim=1)
    return Run(tokens, True, False)


def statistics(runs: list[Run]) -> dict[str, float]:
    in_window = back_to_back = steps = 0
    longest = 0
    for run in runs:
        t = run.tokens
        for i, token in enumerate(t):
            steps += 1
            in_window += token in t[max(0, i - 10) : i]
            back_to_back += i > 0 and t[i - 1] == token
        current = 0
        for i, token in enumerate(t):
            current = current + 1 if i and t[i - 1] == token else 1
            longest = max(longest, current)
    return {
        "repeat_in_window_10": in_window / max(steps, 1),
        "back_to_back": back_to_back / max(steps, 1),
        "longest_run": longest,
        "tokens_per_run": float(np.mean([len(r.tokens) for r in runs])),
        "hit_length_limit": float(np.mean([r.hit_limit for r in runs])),
        "guard_cuts": float(np.mean([r.guard_cut for r in runs])),
    }


def load_lm(model_dir: Path) -> CosyVoice2LM:
    harness = model_dir / "harness_config.json"
    if harness.is_file():
        lm = CosyVoice2LM(LLMConfig.from_harness(json.loads(harness.read_text())["llm"]))
        lm.load_state_dict(torch.load(model_dir / "llm.pt", weights_only=True), strict=True)
        return lm.eval()
    from cosyvoice2.config import EngineConfig  # noqa: PLC0415 - the official layout
    from cosyvoice2.loading import load_llm  # noqa: PLC0415

    return load_llm(model_dir / "llm.pt", EngineConfig.for_model_dir(model_dir), torch.device("cpu"), torch.float32).eval()


def main(argv: list[str] | None = None, report: Callable[[str], None] = print) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--text-tokens", type=int, default=12)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument(
        "--temperature", type=float, default=1.0,
        help="divides the logits for every policy (< 1 sharpens a random-weight model into repeating itself)",
    )  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (small models: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lm = load_lm(args.model_dir)
    rng = np.random.default_rng(1234)
    text_vocab = lm.body.embed_tokens.num_embeddings
    text = rng.integers(0, text_vocab, args.text_tokens).tolist()
    prompt_text = rng.integers(0, text_vocab, 8).tolist()
    prompt_speech = rng.integers(0, lm.config.speech_token_size, args.prompt_tokens).tolist()
    prefix = lm.embed_prefix(CosyVoice2Prefix.of(text, prompt_text, prompt_speech)).float()
    min_len, max_len = 2 * len(text), 20 * len(text)
    results = {}
    report("| policy | repeat within 10 | back-to-back | longest run | tokens/run | at length limit | guard cuts |")
    report("|---|---|---|---|---|---|---|")
    for policy in ("ras", "topk_topp", "penalty", "penalty+guard"):
        runs = [
            decode(lm, prefix, prompt_speech, min_len, max_len, policy, seed, args.temperature) for seed in range(args.runs)
        ]
        s = results[policy] = statistics(runs)
        report(
            f"| {policy} | {s['repeat_in_window_10']:.3f} | {s['back_to_back']:.3f} | {s['longest_run']:.0f} | "
            f"{s['tokens_per_run']:.1f} | {s['hit_length_limit']:.2f} | {s['guard_cuts']:.2f} |"
        )
    return results


if __name__ == "__main__":
    main()
