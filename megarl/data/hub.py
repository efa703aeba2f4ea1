"""Model sources: config paths that name a Hugging Face Hub repo instead of a local directory.

``model.path``, ``model.tokenizer``, ``reference.path``, ``critic.path``, ``reward.model.path``
and ``reward.model.tokenizer`` may each be a Hub id (``Qwen/Qwen2.5-0.5B-Instruct``, optionally
``ID@revision``; ``model.revision`` pins ``model.path`` and ``model.tokenizer``).
:func:`resolve_sources` replaces each id in the config by its local snapshot directory, so the
rest of the run only ever sees local directories, and returns what it resolved (id, revision,
commit) for ``run.json``.

* A value is a Hub id only when it is not an existing path, matches ``org/name`` (no leading
  ``./`` or ``/``, no ``..``) and its first component is not a local directory: a typo'd local
  path like ``runs/tiny-modle`` (``runs/`` exists) still gets a "not a directory" error.
* Online, :func:`huggingface_hub.snapshot_download` fetches only what megarl reads (config,
  tokenizer files, chat templates, ``*.safetensors``).  With ``HF_HUB_OFFLINE=1`` the snapshot
  comes from the local cache (``HF_HUB_CACHE``), and an id that is not there is one error line
  saying how to get it.
* Several processes on one node (torchrun): resolution runs before torch.distributed is up, so
  local rank 0 resolves (and downloads) and hands the exact commit it got to the node's other
  ranks through a small file in the node's temp directory; they read that commit from the
  cache (``local_files_only``), so every rank of a node loads the same files even when the
  branch moves meanwhile.  Nodes resolve independently: pin ``model.revision`` to a commit for
  multi-node runs that must not race a push.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Optional

from megarl.errors import MegarlError

__all__ = ["HubSourceError", "ResolvedSource", "is_hub_id", "resolve_source", "resolve_sources", "hub_cache_dir"]

# what megarl reads from a checkpoint: config, tokenizer (json/txt/sentencepiece/tiktoken),
# chat templates, safetensors weights (no *.bin, no remote code)
TOKENIZER_PATTERNS = ("*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")
MODEL_PATTERNS = TOKENIZER_PATTERNS + ("*.safetensors",)

# Hub repo names: letters, digits, '-', '_', '.'; one '/' between owner and name
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)(?:@(?P<rev>[^\s@]+))?$")
_TRUE = ("1", "true", "yes", "on")


class HubSourceError(MegarlError, ValueError):
    """A Hub id that cannot be resolved; the message names the config key, the id and the fix."""


@dataclass(frozen=True)
class ResolvedSource:
    """One resolved config key: ``path`` is the local snapshot directory the run uses."""

    key: str
    hub_id: str
    revision: Optional[str]
    commit: str
    path: str


def is_hub_id(value) -> bool:
    """``value`` names a Hub repo (``org/name`` or ``org/name@rev``) and not a local path."""
    if not isinstance(value, str) or os.path.exists(value):
        return False
    m = _HUB_ID.match(value)
    if m is None or ".." in m.group("repo") or value.startswith((".", "/", "~")):
        return False
    # "runs/tiny-modle" with runs/ present is a mistyped local path, not a repo of user "runs"
    return not os.path.isdir(m.group("repo").split("/")[0])


def hub_cache_dir() -> str:
    """The Hub cache directory as huggingface_hub resolves it, read from the environment now
    (huggingface_hub reads it once at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(xdg, "huggingface", "hub")


def _offline() -> bool:
    return any(os.environ.get(k, "").strip().lower() in _TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _split(value: str, revision: Optional[str], key: str) -> tuple[str, Optional[str]]:
    m = _HUB_ID.match(value)
    repo, rev = m.group("repo"), m.group("rev")
    if rev and revision and rev != revision:
        raise HubSourceError(f"{key}: {value} pins revision {rev!r} but model.revision is {revision!r}; give one")
    return repo, rev or revision


def _download(key: str, repo: str, revision: Optional[str], patterns, cache_dir: str, local_only: bool) -> str:
    """snapshot_download, every failure turned into one HubSourceError line."""
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError as e:  # a transformers dependency; missing only in a broken install
        raise HubSourceError(f"{key}: {repo} is a Hub id, which needs huggingface_hub "
                             f"(pip install huggingface_hub): {e}") from None
    name = repo + (f"@{revision}" if revision else "")
    try:
        return snapshot_download(repo, revision=revision, allow_patterns=list(patterns), cache_dir=cache_dir,
                                 local_files_only=local_only)
    except GatedRepoError:
        raise HubSourceError(f"{key}: {name} is a gated repo: accept its terms on huggingface.co and log in "
                             f"(`hf auth login`) or set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise HubSourceError(f"{key}: {repo} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise HubSourceError(f"{key}: {name} is neither a local directory nor a model repo on the Hub "
                             f"(a private repo needs `hf auth login` or HF_TOKEN)") from None
    except LocalEntryNotFoundError as e:  # IncompleteSnapshotError included
        if local_only:
            why = "HF_HUB_OFFLINE=1" if _offline() else "local_files_only"
            raise HubSourceError(
                f"{key}: {name} is not in the local Hub cache {cache_dir} ({why}), or only partly; run once online "
                f"or `hf download {repo}{f' --revision {revision}' if revision else ''}` first") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubSourceError(f"{key}: cannot download {name} from the Hub and it is not cached ({first}); "
                             f"check the network, or set HF_HUB_OFFLINE=1 with a cached copy") from None
    except (HfHubHTTPError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubSourceError(f"{key}: downloading {name} from the Hub failed: {first}") from None


def resolve_source(key: str, value: str, *, revision: Optional[str] = None, weights: bool = True,
                   cache_dir: Optional[str] = None, local_files_only: Optional[bool] = None) -> ResolvedSource:
    """Resolve the Hub id ``value`` of config ``key`` to a local snapshot directory.

    ``weights=False`` (tokenizer keys) skips the ``*.safetensors`` files.  ``local_files_only``
    defaults to ``HF_HUB_OFFLINE``; ``cache_dir`` to :func:`hub_cache_dir`.  The snapshot must
    hold a ``config.json`` (a model) or tokenizer files, and safetensors weights for a model.
    """
    repo, rev = _split(value, revision, key)
    cache_dir = cache_dir or hub_cache_dir()
    local_only = _offline() if local_files_only is None else bool(local_files_only)
    path = _download(key, repo, rev, MODEL_PATTERNS if weights else TOKENIZER_PATTERNS, cache_dir, local_only)
    files = set(os.listdir(path))
    name = f"{repo}@{rev}" if rev else repo
    if weights:
        if "config.json" not in files:
            raise HubSourceError(f"{key}: {name} has no config.json (expected an HF model repo)")
        if not any(f.endswith(".safetensors") for f in files):
            raise HubSourceError(f"{key}: {name} has no *.safetensors weights (megarl loads safetensors only)")
    elif not files & {"tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json"}:
        raise HubSourceError(f"{key}: {name} has no tokenizer files (tokenizer.json / tokenizer_config.json)")
    # snapshots/<commit>: the folder name is the commit snapshot_download resolved
    return ResolvedSource(key=key, hub_id=repo, revision=rev, commit=os.path.basename(os.path.normpath(path)),
                          path=path)


# ---- the config keys, and the hand-off between the ranks of one node -----------------------------


def _source_keys(cfg):
    """(key, owner object, attribute, revision, weights) for every config key that may name a Hub id."""
    m, rm = cfg.model, cfg.reward.model
    rev = getattr(m, "revision", None)
    out = [("model.path", m, "path", rev, True), ("model.tokenizer", m, "tokenizer", rev, False),
           ("reference.path", cfg.reference, "path", None, True)]
    if cfg.critic is not None:
        out.append(("critic.path", cfg.critic, "path", None, True))
    out += [("reward.model.path", rm, "path", None, True), ("reward.model.tokenizer", rm, "tokenizer", None, False)]
    for i, entry in enumerate(cfg.reward.models):
        out += [(f"reward.models[{i}].path", entry, "path", None, True),
                (f"reward.models[{i}].tokenizer", entry, "tokenizer", None, False)]
    return out


def _handoff_path(key: str, value: str) -> str:
    # one file per job and node: the local ranks of a torchrun job share the agent (their parent)
    job = "|".join([str(os.getppid()), os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                    os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", ""),
                    os.environ.get("SLURM_JOB_ID", "")])
    tag = hashlib.sha256(f"{job}|{key}|{value}".encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"megarl-hub-{tag}.json")


def _publish(path: str, payload: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f)
    os.replace(tmp, path)  # atomic: a waiting rank never reads half a file


def _await(path: str, key: str, timeout_s: float) -> dict:
    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout_s:
            raise HubSourceError(f"{key}: timed out after {timeout_s:.0f}s waiting for local rank 0 to resolve it")
        time.sleep(0.2)
    with open(path) as f:
        return json.load(f)


def resolve_sources(cfg, *, local_rank: Optional[int] = None, local_world: Optional[int] = None,
                    timeout_s: float = 3600.0) -> dict:
    """Replace every Hub id in ``cfg`` (see :func:`_source_keys`) by its local snapshot directory.

    Returns ``{key: {"hub_id", "revision", "commit", "path"}}`` for the keys that were Hub ids
    (empty when none were: nothing is imported then).  ``local_rank`` / ``local_world`` default
    to ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE`` (torchrun): local rank 0 resolves, the other local
    ranks take its commit from the cache; without ``LOCAL_RANK`` every process resolves alone.
    A failure on local rank 0 is handed on, so every rank exits with the same error line.
    """
    if local_rank is None and local_world is None and "LOCAL_RANK" not in os.environ:
        local_rank, local_world = 0, 1  # not torchrun: no node-local peers known, resolve here
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world is None:
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    resolved: dict = {}
    for key, owner, attr, rev, weights in _source_keys(cfg):
        value = getattr(owner, attr)
        if not is_hub_id(value):
            continue
        handoff = _handoff_path(key, value)
        if local_rank == 0:
            try:
                src = resolve_source(key, value, revision=rev, weights=weights)
            except HubSourceError as e:
                if local_world > 1:
                    _publish(handoff, {"error": str(e)})
                raise
            if local_world > 1:
                _publish(handoff, {"commit": src.commit})
        else:
            got = _await(handoff, key, timeout_s)
            if "error" in got:
                raise HubSourceError(got["error"])
            src = resolve_source(key, value.split("@")[0], revision=got["commit"], weights=weights,
                                 local_files_only=True)
            src = ResolvedSource(key, src.hub_id, _split(value, rev, key)[1], src.commit, src.path)
        setattr(owner, attr, src.path)
        resolved[key] = {k: v for k, v in asdict(src).items() if k != "key"}
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{key}: {value} is Hub commit {src.commit[:12]} ({src.path})", flush=True)
    return resolved
