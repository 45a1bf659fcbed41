"""A model named by its Hugging Face Hub id, resolved to a local directory through huggingface_hub.

    resolve_model("Qwen/Qwen3.5-4B", revision=None) -> ".../hub/models--Qwen--Qwen3.5-4B/snapshots/<sha>"
    resolve_model("/ckpt/Qwen3.5-4B")               -> "/ckpt/Qwen3.5-4B" (a directory is used as it is)

The Hub's own cache and conventions, as `vllm serve` and transformers follow them: the cache is
$HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (read at each call, not at import, so a
test or a wrapper can point it elsewhere); HF_HUB_OFFLINE=1 never touches the network and serves what the
cache holds; a token comes from HF_TOKEN or `hf auth login`, as huggingface_hub finds it. Only the files
the engine reads are downloaded (ENGINE_FILES: the config, the safetensors and their index, the tokenizer
and chat template, the image preprocessor's config), with huggingface_hub's progress bars.

No torch here: `deltaserve serve` resolves the model before it loads anything, so a missing model is one
line and a non-zero exit, not a traceback from the engine thread. Every failure is a ConfigError whose
message names what is missing and how to get it.
"""
from __future__ import annotations

import os
import re

from .errors import ConfigError

# what the engine reads from a model directory (model/loader.py, text/tokenizer.py, media/images.py)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "additional_chat_templates/*", "generation_config.json")
ENGINE_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "preprocessor_config.json",
                *TOKENIZER_FILES)

# a Hub repository id: NAME or ORG/NAME, letters, digits, '-', '_', '.' (huggingface_hub's own rule)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95})?")
_TRUE = ("1", "ON", "YES", "TRUE")
_resolved: dict[tuple, str] = {}  # (id, revision, what, cache) -> directory, once per process


def hub_cache() -> str:
    """The Hub cache directory huggingface_hub uses under the current environment."""
    if os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE"):
        return os.path.expanduser(os.environ.get("HF_HUB_CACHE") or os.environ["HUGGINGFACE_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return os.path.join(os.path.expanduser(home), "hub")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in _TRUE


def is_hub_id(name: str) -> bool:
    """name reads as a Hub repository id and names nothing on this disk (a path that exists always wins)."""
    return (not os.path.exists(name) and bool(_REPO_ID.fullmatch(name)) and ".." not in name
            and not name.endswith((".json", ".safetensors")))


def resolve_model(name: str | None, revision: str | None = None, what: str = "model") -> str | None:
    """The local directory of `name`: a path on this disk as it is (None stays None: the embedded model), a Hub
    id through the Hub cache, downloading ENGINE_FILES (TOKENIZER_FILES for what="tokenizer") unless offline.
    ConfigError: a path that does not exist, a revision given with a local directory, or a Hub id that cannot
    be had (offline and not cached, not on the Hub, gated, no network)."""
    if name is None:
        return None
    if os.path.exists(name) or not is_hub_id(name):
        if not os.path.exists(name):
            raise ConfigError(f"{what} {name}: no such directory, and not a Hugging Face Hub id (ORG/NAME)")
        if revision is not None:
            raise ConfigError(f"--revision {revision} names a Hub revision, but --{what} {name} is a local directory")
        return name
    key = (name, revision, what, hub_cache())
    if key not in _resolved:
        _resolved[key] = _snapshot(name, revision, what)
    return _resolved[key]


def _snapshot(repo_id: str, revision: str | None, what: str) -> str:
    from huggingface_hub import snapshot_download  # only for a Hub id: plain directories never import it
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    rev = revision or "main"
    cache, offline = hub_cache(), hub_offline()
    get = ("run once with network access" + (" (unset HF_HUB_OFFLINE)" if offline else "")
           + f", or `hf download {repo_id}") + (
        f" --revision {revision}" if revision else "") + "`, or give a local directory"
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                 allow_patterns=list(TOKENIZER_FILES if what == "tokenizer" else ENGINE_FILES))
    except RevisionNotFoundError:
        raise ConfigError(f"{what} {repo_id}: the Hub has no revision {rev!r}") from None
    except GatedRepoError:
        raise ConfigError(f"{what} {repo_id} is gated on the Hub: accept its terms on its page and set HF_TOKEN "
                          "(or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"{what} {repo_id}: no such repository on the Hugging Face Hub (a private one needs "
                          "HF_TOKEN), and no such local directory") from None
    except LocalEntryNotFoundError as e:  # offline (or no network) and not in the cache, or an incomplete snapshot
        cause = ("HF_HUB_OFFLINE=1 forbids downloading it" if offline
                 else f"the Hub could not be reached ({type(e.__cause__ or e).__name__})")
        state = "is incomplete in" if type(e).__name__ == "IncompleteSnapshotError" else "is not in"
        raise ConfigError(f"{what} {repo_id} (revision {rev}) {state} the Hugging Face cache {cache} and {cause}: "
                          f"{get}") from None
    except HfHubHTTPError as e:
        raise ConfigError(f"{what} {repo_id}: the Hub answered {str(e).splitlines()[0]}") from None
    missing = _missing(path, what)
    if missing:
        raise ConfigError(f"{what} {repo_id} (revision {rev}): the cached snapshot {path} has no {missing}: {get}")
    return path


def _missing(path: str, what: str) -> str | None:
    """What a snapshot lacks that the engine needs, named for the user, or None."""
    names = set()
    for root, _, files in os.walk(path):
        names.update(files)
    if what == "tokenizer":
        return None if names & {"tokenizer.json", "tokenizer_config.json"} else "tokenizer (tokenizer.json)"
    if "config.json" not in names:
        return "config.json"
    if not any(n.endswith(".safetensors") for n in names):
        return "weights (*.safetensors)"
    return None
