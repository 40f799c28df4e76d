"""The exception tree. Each error knows its HTTP status and its OpenAI error ``type``.

    ElbowroomError (500, server_error)
    ├── BadRequest (400, invalid_request_error)
    │   └── ContextOverflow (400): the prompt does not fit the context
    ├── Unauthorized (401, authentication_error)
    ├── Forbidden (403, permission_error): a foreign Host/Origin, or a key without admin rights
    ├── ModelNotFound (404, not_found_error)
    ├── RequestTimeout (408, invalid_request_error): a body that stopped arriving
    ├── PayloadTooLarge (413, invalid_request_error)
    ├── UnsupportedMediaType (415, invalid_request_error): a body that is not JSON
    ├── Unprocessable (422, invalid_request_error)
    ├── Unavailable (503, service_unavailable): retry later; carries retry_after seconds
    │   ├── QueueFull (503): the model's queue is full
    │   ├── RunnerCrashed (503): the runner died (exit code / signal named)
    │   ├── RunnerBackoff (503): the runner crashed repeatedly; restart is backing off
    │   └── MemoryPressure (503, memory_pressure): the guard refused or aborted the work
    ├── InsufficientMemory (507, insufficient_memory): the model cannot fit even after
    │                        evicting everything evictable; ``details`` has the numbers
    └── EngineError (500, server_error): the engine failed in a way we did not foresee

Library errors are translated into these in one place per engine with ``raise ... from``.
``to_openai()`` gives the body every HTTP error response uses:
``{"error": {"message", "type", "param", "code", ...details}}``.
"""

from __future__ import annotations

from typing import Any, ClassVar


class ElbowroomError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.details = details or {}

    def to_openai(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "message": self.message,
            "type": self.type,
            "param": self.param,
            "code": self.code,
        }
        body.update(self.details)
        return {"error": body}

    def headers(self) -> dict[str, str]:
        return {}

    def to_wire(self) -> dict[str, Any]:
        """A picklable description, to cross the runner pipe and be rebuilt by from_wire."""
        return {
            "class": type(self).__name__,
            "message": self.message,
            "param": self.param,
            "code": self.code,
            "details": self.details,
        }

    @staticmethod
    def from_wire(wire: dict[str, Any]) -> ElbowroomError:
        cls = _BY_NAME.get(str(wire.get("class")), EngineError)
        err = cls.__new__(cls)
        ElbowroomError.__init__(
            err,
            str(wire.get("message", "unknown error")),
            param=wire.get("param"),
            code=wire.get("code"),
            details=wire.get("details") or {},
        )
        if isinstance(err, Unavailable):
            err.retry_after = float(wire.get("details", {}).get("retry_after", 1.0))
        return err


class BadRequest(ElbowroomError):
    status = 400
    type = "invalid_request_error"


class ContextOverflow(BadRequest):
    def __init__(self, message: str, **kw: Any) -> None:
        kw.setdefault("code", "context_length_exceeded")
        super().__init__(message, **kw)


class Unauthorized(ElbowroomError):
    status = 401
    type = "authentication_error"


class Forbidden(ElbowroomError):
    status = 403
    type = "permission_error"


class ModelNotFound(ElbowroomError):
    status = 404
    type = "not_found_error"

    def __init__(self, model: str, **kw: Any) -> None:
        kw.setdefault("code", "model_not_found")
        kw.setdefault("param", "model")
        super().__init__(
            f"The model {model!r} does not exist. GET /v1/models lists the available ones.", **kw
        )


class ResponseNotFound(ElbowroomError):
    status = 404
    type = "not_found_error"


class RequestTimeout(ElbowroomError):
    status = 408
    type = "invalid_request_error"


class PayloadTooLarge(ElbowroomError):
    status = 413
    type = "invalid_request_error"


class UnsupportedMediaType(ElbowroomError):
    status = 415
    type = "invalid_request_error"


class Unprocessable(ElbowroomError):
    status = 422
    type = "invalid_request_error"


class Unavailable(ElbowroomError):
    status = 503
    type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kw: Any) -> None:
        details = dict(kw.pop("details", None) or {})
        details["retry_after"] = retry_after
        super().__init__(message, details=details, **kw)
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class QueueFull(Unavailable):
    pass


class RunnerCrashed(Unavailable):
    pass


class RunnerBackoff(Unavailable):
    pass


class MemoryPressure(Unavailable):
    type = "memory_pressure"


class InsufficientMemory(ElbowroomError):
    status = 507
    type = "insufficient_memory"


class EngineError(ElbowroomError):
    status = 500
    type = "server_error"


def _all_subclasses(cls: type[ElbowroomError]) -> list[type[ElbowroomError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


_BY_NAME: dict[str, type[ElbowroomError]] = {c.__name__: c for c in _all_subclasses(ElbowroomError)}
