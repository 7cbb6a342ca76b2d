"""Where a served model's files are: `--model` as a local directory or a Hugging Face Hub id.

`resolve_model_dir` is the one resolver behind every entry point (`cleave generate`,
`cleave up`, each service's `--model`): a path that exists is used as it is; `ORG/NAME` or
`ORG/NAME@REVISION` is fetched through `huggingface_hub`, which brings its cache (HF_HOME /
HF_HUB_CACHE), its token (HF_TOKEN, or the stored login) and offline mode (HF_HUB_OFFLINE=1:
the cache only) from its own documented environment. Only the files cleave loads are
fetched (config, tokenizer, safetensors), never other weight formats.

Torch-free: the gateway resolves its model the same way.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from cleave.model.text_config import architecture_of, read_config_json

# config.json, generation_config.json, tokenizer*.json, cleave_config.json; weights; templates
HUB_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model")
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?$")


class ModelNotFound(Exception):
    """`--model` names no usable checkpoint; the message says which and why, in one line."""


def hub_id(model_arg: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `model_arg` reads as `ORG/NAME[@REVISION]`, else None."""
    match = _HUB_ID.match(model_arg)
    if match is None:
        return None
    return match["repo"], match["revision"]


def resolve_model_dir(model_arg: str, default_dir: Path | None = None) -> Path:
    """The local checkpoint directory for `--model`; raises ModelNotFound.

    An empty `model_arg` means `default_dir` (the shipped model). A path that exists wins
    over a Hub id of the same spelling, as it does for `transformers`.
    """
    if not model_arg:
        if default_dir is None or not (default_dir / "config.json").is_file():
            raise ModelNotFound(f"no --model given and no shipped model in {default_dir}")
        return default_dir
    path = Path(model_arg).expanduser()
    if path.exists() or hub_id(model_arg) is None:
        return _checkpoint_dir(path, model_arg)
    repo, revision = hub_id(model_arg)  # type: ignore[misc]
    return _checkpoint_dir(_from_hub(model_arg, repo, revision), model_arg)


def _checkpoint_dir(path: Path, model_arg: str) -> Path:
    if not path.is_dir():
        raise ModelNotFound(f"--model {model_arg}: no such directory")
    if not (path / "config.json").is_file():
        raise ModelNotFound(f"--model {model_arg}: not a checkpoint directory (it has no config.json); give a "
                            "directory with config.json, the *.safetensors weights and the tokenizer files")
    try:  # before any process loads it: one line, not a KeyError in a worker's log
        architecture_of(read_config_json(path))
    except json.JSONDecodeError as error:
        raise ModelNotFound(f"--model {model_arg}: its config.json is not JSON ({error})") from None
    except ValueError as error:
        raise ModelNotFound(f"--model {model_arg}: {error}") from None
    return path


def _from_hub(model_arg: str, repo: str, revision: str | None) -> Path:
    """The snapshot directory of a Hub model, downloaded into the cache unless there."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=list(HUB_FILES)))
    except LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE:
            raise ModelNotFound(
                f"--model {model_arg}: not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and HF_HUB_OFFLINE=1 "
                f"forbids downloading it; run `hf download {repo}` with network access, or unset HF_HUB_OFFLINE"
            ) from None
        raise ModelNotFound(f"--model {model_arg}: the Hugging Face Hub cannot be reached and the model is not in "
                            f"the cache ({constants.HF_HUB_CACHE}); check the network or pass a local directory") from None
    except GatedRepoError:
        raise ModelNotFound(f"--model {model_arg}: the repository is gated; accept its terms on huggingface.co "
                            "and set HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(f"--model {model_arg}: no such repository on the Hugging Face Hub (or it is private: "
                            "set HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"--model {model_arg}: the repository has no revision {revision!r}") from None
    except HfHubHTTPError as error:
        raise ModelNotFound(f"--model {model_arg}: the Hugging Face Hub answered {error}".splitlines()[0]) from None
