"""A Hugging Face Hub id (``org/name``) as a snapshot directory in the local hub cache.

The cache is tried first with no network, so a cached model starts the same online or off; a model that is not
there is downloaded, only the files a model needs, unless ``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import re
from pathlib import Path

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.tiktoken", "*.txt", "*.py"]


def looks_like_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and ".." not in name


def hub_cache_dir() -> str:
    return constants.HF_HUB_CACHE


def hub_snapshot(repo_id: str) -> Path:
    """The local directory of ``repo_id``: from the cache, else downloaded (unless offline)."""
    cache = constants.HF_HUB_CACHE
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES, local_files_only=True))
    except LocalEntryNotFoundError:
        pass  # not cached (or cached in part): download, if we may
    if constants.HF_HUB_OFFLINE:
        raise FileNotFoundError(f"not in the hub cache {cache}, and HF_HUB_OFFLINE=1 forbids a download")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except (OSError, ValueError) as e:  # no network, no such repo, gated, a bad id: all end here, named
        reason = str(e).strip().splitlines()[0].removeprefix("Got: ") if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"not in the hub cache {cache}, and the download failed: {reason}") from e
