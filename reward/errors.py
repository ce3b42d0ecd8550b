"""The judge's errors, as callers see them (over relay they keep their type)."""

from __future__ import annotations

import relay


@relay.register(name="reward.BadMessages")
class BadMessages(ValueError):
    """The 'messages' value is malformed (HTTP 422, as in the original); other bad requests are 400."""


@relay.register(name="reward.TextOnly")
class TextOnly(ValueError):
    """A message holds an image or video part: the judge serves text only (HTTP 400; a VL
    checkpoint's vision tower is not loaded)."""


@relay.register(name="reward.UnknownRouteKey")
class UnknownRouteKey(ValueError):
    """No judge instance is registered under the request's ``route_key`` (HTTP 400)."""


@relay.register(name="reward.JudgeAsleep")
class JudgeAsleep(RuntimeError):
    """The judge instance is asleep (its GPUs are lent to training); retry later (HTTP 503)."""


@relay.register(name="reward.JudgeUnavailable")
class JudgeUnavailable(RuntimeError):
    """The instance has no working engine, or every attempt of the request failed in
    transport (HTTP 503)."""


@relay.register(name="reward.JudgeEngineError")
class JudgeEngineError(RuntimeError):
    """Engines failed this request in every attempt (failed steps, not the request's fault:
    the engines recovered). HTTP 502; the service already tried it ``ATTEMPTS`` times
    (reward/dispatch.py)."""
