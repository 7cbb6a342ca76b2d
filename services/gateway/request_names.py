"""Names a request may use, checked the same way by the gRPC and the OpenAI HTTP APIs.

Both front ends turn a request into a `GenerateSpec`; the chat roles they accept and the
way a `model` field picks a served model live here once, so the two APIs cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cleave.config import ModelConfig
from cleave.errors import InvalidArgument, NotFound

# OpenAI's `developer` role is its newer name for `system`; chat templates know only
# `system`, so it is accepted and renamed.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
_ROLE_ALIASES = {"developer": "system"}


def chat_role(role: Any, field: str) -> str:
    """The role a chat template sees for a message's `role` (`developer` becomes `system`);
    InvalidArgument naming `field` when it is not one of CHAT_ROLES."""
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise InvalidArgument(f"unknown role {role!r}; use one of {', '.join(CHAT_ROLES)}", field=field)
    return _ROLE_ALIASES.get(role, role)


def resolve_model(models: Sequence[ModelConfig], name: Any) -> str:
    """The id of the served model a request's `model` names; an empty or missing name picks
    the first (default) model. InvalidArgument for a non-string, NotFound for an id not
    served here (the message lists the served ids)."""
    if name is None or name == "":
        return models[0].id
    if not isinstance(name, str):
        raise InvalidArgument(f"must be a model id string, got {type(name).__name__}", field="model")
    if name not in {entry.id for entry in models}:
        served = ", ".join(entry.id for entry in models)
        raise NotFound(f"model {name!r} is not served here; served: {served}", field="model")
    return name


def context_length(models: Sequence[ModelConfig], model_id: str) -> int:
    """The context of the served model `model_id` (a `resolve_model` id), in tokens; 0 when
    its configuration leaves it unknown. Both APIs count a prompt's parts against it before
    reading them (`prompt_bounds`)."""
    return next(entry.max_context_length for entry in models if entry.id == model_id)
