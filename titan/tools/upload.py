"""`titan convert dcp-to-hf ... --push-to-hub REPO`: the exported folder uploaded to a hub model repository (created
if need be) through huggingface_hub, with the credentials it finds (HF_TOKEN, or the token `hf auth login` saved).
The repository name and the credentials are checked before the export, which can take long; the hub's answer
after it, when the folder is complete and can be pushed again by hand."""

from __future__ import annotations

from pathlib import Path

from titan.errors import UserError, installed
from titan.tools.download import LOGIN_HINT, _first_line


def check_push(repo_id: str) -> None:
    """UserError unless `repo_id` is a hub repository name and credentials are there to push to it."""
    from huggingface_hub import get_token
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserError(
            f"--push-to-hub {repo_id!r} is not a hub repository name: give owner/name, e.g. alice/my-model"
        ) from None
    if get_token() is None:
        raise UserError(f"--push-to-hub {repo_id}: no Hugging Face credentials: {LOGIN_HINT}, with write access")


def push(folder: Path, repo_id: str, private: bool) -> str:
    """Upload the files of `folder` to hub model `repo_id` in one commit (the repository is created if it does not
    exist, private if asked); returns the report to print."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    api = HfApi()
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        api.upload_folder(repo_id=repo_id, folder_path=folder, commit_message=f"titan export to {folder.name}")
        return f"pushed {folder} to {url}"
    except HfHubHTTPError as e:  # a refusal: no rights, a bad token, a name taken
        problem = f"the hub answered {_first_line(e)}"
    except _connection_errors() as e:
        problem = f"cannot reach the hub at {api.endpoint} ({_first_line(e)})"
    raise UserError(
        f"--push-to-hub {repo_id}: {problem}; the export in {folder} is complete: push it with "
        f"`hf upload {repo_id} {folder}` once that is fixed"
    )


def _connection_errors() -> tuple[type[Exception], ...]:
    """What huggingface_hub's HTTP client raises when the hub cannot be reached: requests' errors (huggingface_hub
    0.x) are OSErrors; httpx's (1.x) and httpx2's (2.x) derive from their HTTPError."""
    import importlib

    return (OSError, *(importlib.import_module(name).HTTPError for name in ("httpx", "httpx2") if installed(name)))
