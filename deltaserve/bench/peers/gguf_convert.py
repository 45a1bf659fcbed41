"""Run llama.cpp's `convert_hf_to_gguf.py` on a deltaserve checkpoint (benchmark only; llama.cpp is never
a dependency of deltaserve). Executed as a script in a subprocess, with the llama.cpp tree given first:

    python gguf_convert.py LLAMA_CPP_TREE MODEL_DIR --outtype bf16 --outfile F.gguf [--no-mtp]

Everything after the tree goes to the converter unchanged. The one thing this wrapper adds: the converter
identifies a BPE tokenizer's pre-tokenizer by hashing how it encodes a probe string, and our embedded
tokenizer's hash is not in its table (the vocabulary is our own), so it refuses. When the tokenizer's split
regex is exactly the one llama.cpp's `qwen2` pre-tokenizer implements (Qwen's own), `qwen2` is the right
choice and is returned instead of the error; any other regex keeps the converter's error. The tree on disk
is not modified: the method is replaced in this process only.
"""
from __future__ import annotations

import json
import os
import runpy
import sys

# The split regex of Qwen2/Qwen3/Qwen3.5 tokenizer.json files, which llama.cpp implements as `qwen2`
# (src/llama-vocab.cpp quotes it as the "original regex from tokenizer.json").
QWEN2_SPLIT_REGEX = ("(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
                     "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+")


def split_regexes(tokenizer_json: dict) -> list[str]:
    """The Split pre-tokenizers' regexes of a tokenizer.json, in order (a Sequence is walked)."""
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    return [p["pattern"]["Regex"] for p in parts if p.get("type") == "Split" and "Regex" in p.get("pattern", {})]


def fallback_pre(model_dir: str) -> str | None:
    """'qwen2' when the checkpoint's tokenizer splits exactly as llama.cpp's qwen2 pre-tokenizer, else None."""
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        regexes = split_regexes(json.load(f))
    return "qwen2" if regexes == [QWEN2_SPLIT_REGEX] else None


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        raise SystemExit("usage: gguf_convert.py LLAMA_CPP_TREE MODEL_DIR [convert_hf_to_gguf.py options]")
    tree, args = os.path.abspath(argv[0]), argv[1:]
    script = os.path.join(tree, "convert_hf_to_gguf.py")
    if not os.path.exists(script):
        raise SystemExit(f"no convert_hf_to_gguf.py in {tree} (run scripts/setup_llama_cpp.sh)")
    # the tree's own gguf-py: the released gguf package lags the converter
    sys.path[:0] = [tree, os.path.join(tree, "gguf-py")]
    from conversion.base import TextModel  # the tree's module, cached for the run below

    model_dir = next(a for a in args if not a.startswith("-"))
    pre = fallback_pre(model_dir)
    original = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if pre is None:
                raise
            print(f"[gguf_convert] pre-tokenizer hash unknown to the converter; split regex is qwen2's: using {pre!r}",
                  file=sys.stderr)
            return pre

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
