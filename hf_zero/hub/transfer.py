"""Push a trained model folder to the Hugging Face Hub and pull one back, with a model card.

Everything that touches the network goes through ``huggingface_hub`` (``HfApi.create_repo``,
``create_branch``, ``upload_folder``, ``snapshot_download``), so proxies, ``HF_ENDPOINT``,
retries, LFS/Xet uploads and the cache layout are exactly what the rest of the Hugging Face
stack does. hf_zero adds three things on top:

- a model card (``README.md``, :mod:`hf_zero.hub.model_cards.card`) when the folder has none, saying
  how the model was trained from what the save recorded in the folder (resolved ZeRO config,
  hardware, hyperparameters, results, versions), ``library_name: peft`` for an adapter folder;
- the rule that resume state stays local: ``save_checkpoint`` tag folders (``global_step*``),
  the ``latest`` pointer, half-written ``.<tag>.partial`` folders and ``Trainer``'s
  ``checkpoint-*`` folders hold optimizer state and RNG, are large, and are of no use to
  someone who wants the weights, so they are uploaded only when asked for;
- one-sentence errors (:class:`HubError`) naming the folder, repo and revision, instead of
  an HTTP traceback.

Tokens are never read, printed or written here: a ``token`` argument is passed through to
``huggingface_hub``, and without one it finds ``HF_TOKEN`` or the login cache itself.
"""

from __future__ import annotations

import contextlib
import fnmatch
import importlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from hf_zero.errors import HubError
from hf_zero.hub.model_cards.card import WEIGHT_PATTERNS, render_model_card

__all__ = ["HubError", "RESUME_STATE_PATTERNS", "WEIGHT_PATTERNS", "pull_from_hub", "push_to_hub", "render_model_card"]

# Glob patterns (relative to the pushed folder; ``huggingface_hub`` matches them with fnmatch, whose
# ``*`` also crosses ``/``) for resume state, left out of uploads unless include_resume_state=True.
RESUME_STATE_PATTERNS: tuple[str, ...] = (
    "global_step*/*",  # engine.save_checkpoint tags (the default tag is global_step<N>)
    "*/global_step*/*",  # ... inside Trainer's checkpoint-<N> folders
    "latest",  # the pointer to the newest tag
    "*/latest",
    ".*.partial/*",  # a save that was interrupted before its rename
    "*/.*.partial/*",
    "checkpoint-*/*",  # Trainer's resume folders (optimizer, scheduler, RNG, trainer_state.json)
)

DEFAULT_COMMIT_MESSAGE = "Upload model trained with hf_zero"


# ------------------------------------------------------------------------ errors


def _transport_errors() -> tuple[type[BaseException], ...]:
    """Connection-level exceptions of whichever HTTP library this huggingface_hub uses.

    huggingface_hub >= 1.0 talks through httpx (``httpx2`` in recent releases), older ones through
    requests; none of them wraps "could not connect" in its own error type, so we look them up.
    """
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (
        ("httpx2", "TransportError"),
        ("httpx", "TransportError"),
        ("requests", "ConnectionError"),
        ("requests", "Timeout"),
    ):
        with contextlib.suppress(ImportError, AttributeError):
            found.append(getattr(importlib.import_module(module), name))
    return tuple(found)


def _first_line(text: object) -> str:
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    return lines[0].rstrip(".") if lines else ""


@contextlib.contextmanager
def _hub_errors(action: str, repo_id: str, revision: str | None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions (multi-line, with URLs) into one-sentence :class:`HubError`."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        yield
    except HubError:
        raise
    except HFValidationError as e:
        raise HubError(f"cannot {action} {repo_id!r}: {_first_line(e)}.") from e
    except GatedRepoError as e:
        raise HubError(
            f"cannot {action} {repo_id}: it is a gated repository and this token has no access to it."
        ) from e
    except RepositoryNotFoundError as e:
        raise HubError(
            f"repository {repo_id} was not found on {constants.ENDPOINT}{at} "
            "(or the token in use cannot see it)."
        ) from e
    except RevisionNotFoundError as e:
        raise HubError(f"revision {revision or 'main'!r} was not found in repository {repo_id}.") from e
    except HfHubHTTPError as e:
        status = getattr(getattr(e, "response", None), "status_code", None)
        detail = getattr(e, "server_message", None) or _first_line(e)
        if status == 401:
            raise HubError(
                f"the Hub rejected the token while trying to {action} {repo_id} (log in with "
                "`hf auth login` or set HF_TOKEN)."
            ) from e
        raise HubError(
            f"cannot {action} {repo_id}{at}: the Hub answered {status}: {_first_line(detail)}."
        ) from e
    except LocalEntryNotFoundError as e:  # snapshot_download's "offline and nothing cached"
        if isinstance(e.__cause__, _transport_errors()):
            raise HubError(_unreachable(action, repo_id, e.__cause__)) from e
        raise HubError(f"cannot {action} {repo_id}{at}: {_first_line(e)}.") from e
    except ValueError as e:  # e.g. "Invalid metadata in README.md." followed by one line per problem
        lines = [line.strip(" -") for line in str(e).splitlines() if line.strip(" -")]
        raise HubError(f"cannot {action} {repo_id}{at}: {'; '.join(lines).rstrip('.')}.") from e
    except Exception as e:
        if isinstance(e, _transport_errors()):
            raise HubError(_unreachable(action, repo_id, e)) from e
        raise


def _unreachable(action: str, repo_id: str, error: BaseException) -> str:
    from huggingface_hub import constants

    reason = type(error).__name__
    return f"cannot {action} {repo_id}: the Hub at {constants.ENDPOINT} could not be reached ({reason})."


# ------------------------------------------------------------------------ push / pull


def _check_model_folder(folder: str) -> None:
    if not os.path.exists(folder):
        raise HubError(f"cannot push {folder}: the folder does not exist.")
    if not os.path.isdir(folder):
        raise HubError(f"cannot push {folder}: it is a file, not a folder.")
    if not any(fnmatch.fnmatch(n, p) for n in os.listdir(folder) for p in WEIGHT_PATTERNS):
        raise HubError(
            f"cannot push {folder}: it has no model weights (no *.safetensors, pytorch_model*.bin, "
            "*.gguf or *.pt at its top level); save the model there first, or turn a resume "
            "checkpoint into weights with `hf-zero consolidate`."
        )


def resume_state_patterns(folder: str) -> list[str]:
    """:data:`RESUME_STATE_PATTERNS` plus the tag that ``folder/latest`` names (tags can have any name)."""
    patterns = list(RESUME_STATE_PATTERNS)
    with contextlib.suppress(OSError, UnicodeDecodeError):
        with open(os.path.join(folder, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
        if tag and "/" not in tag and os.path.isdir(os.path.join(folder, tag)):
            patterns.append(f"{tag}/*")
    return patterns


def _write_atomic(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".README.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def push_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    *,
    revision: str | None = None,
    private: bool | None = None,
    commit_message: str | None = None,
    token: str | None = None,
    create_pr: bool = False,
    include_resume_state: bool = False,
    card_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Upload a saved model folder to ``repo_id`` in one commit; returns the commit (or PR) URL.

    The repo is created if missing (``private`` applies only then); a ``revision`` that names a
    branch that does not exist yet is created from ``main``, so "push this run to its own branch"
    is one call. If the folder has no ``README.md``, a model card is rendered
    (``render_model_card(folder, **card_kwargs)``) and written into the folder first, so the
    local folder and the repo stay the same. Resume state is left out unless
    ``include_resume_state`` (see :data:`RESUME_STATE_PATTERNS`). Files already on the Hub with
    the same content are not uploaded again (huggingface_hub compares hashes).
    """
    from huggingface_hub import HfApi

    folder = os.fspath(folder)
    _check_model_folder(folder)
    if create_pr and revision not in (None, "main"):
        raise HubError(
            f"--create-pr opens a pull request against main; it cannot be combined with revision "
            f"{revision!r}."
        )
    api = HfApi(token=token)
    with _hub_errors("push to", repo_id, revision):
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        if revision and revision != "main" and not revision.startswith("refs/"):
            api.create_branch(repo_id, branch=revision, exist_ok=True, repo_type="model")
        readme = os.path.join(folder, "README.md")
        if not os.path.exists(readme):
            text = render_model_card(folder, **{"repo_id": repo_id, **dict(card_kwargs or {})})
            if token and token in text:  # cannot happen through our template; refuse rather than publish
                raise HubError("the rendered model card contains the access token; not pushing it.")
            _write_atomic(readme, text)
        info = api.upload_folder(
            folder_path=folder,
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            commit_message=commit_message or DEFAULT_COMMIT_MESSAGE,
            ignore_patterns=None if include_resume_state else resume_state_patterns(folder),
            create_pr=create_pr,
        )
    return str(info.pr_url if create_pr and info.pr_url else info.commit_url)


def pull_from_hub(
    repo_id: str,
    local_dir: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | None = None,
    include_resume_state: bool = True,
) -> str:
    """Download ``repo_id`` (at ``revision``, default ``main``) into ``local_dir``; returns its path.

    A thin ``snapshot_download(local_dir=...)``: the files land as plain files in ``local_dir``
    (huggingface_hub keeps its bookkeeping under ``local_dir/.cache/huggingface``), so the folder
    can be passed to ``from_pretrained`` or ``load_checkpoint`` directly. Resume state is pulled
    by default, since a pull is how a run is continued on another machine;
    ``include_resume_state=False`` fetches only what inference needs.
    """
    from huggingface_hub import snapshot_download

    local_dir = os.fspath(local_dir)
    if os.path.exists(local_dir) and not os.path.isdir(local_dir):
        raise HubError(f"cannot pull into {local_dir}: it is a file, not a folder.")
    with _hub_errors("pull", repo_id, revision):
        return snapshot_download(
            repo_id=repo_id,
            repo_type="model",
            revision=revision,
            local_dir=local_dir,
            token=token,
            ignore_patterns=None if include_resume_state else list(RESUME_STATE_PATTERNS),
        )
