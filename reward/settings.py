"""The reward layer's ``RELAY_*`` environment variables (relay's :class:`~relay.Layer` shape;
docs/relay.md lists every layer's): ``settings()`` gives their values."""

from __future__ import annotations

from relay.variables import Layer, Variable, text

VARIABLES = (
    Variable("RELAY_GENRM_ADDR", "genrm_addr", "", text, "reward",
             "the judge service's relay address, for reward code (set by the launcher)"),
    Variable("RELAY_GENRM_ACTOR", "genrm_actor", "genrm", text, "reward", "the judge service's actor name"),
    Variable("RELAY_GENRM_URL", "genrm_url", "", text, "reward",
             "the judge's HTTP gateway (`http://127.0.0.1:PORT/genrm`), for reward code (set by the launcher)"),
    Variable("RELAY_GENRM_TOKEN", "genrm_token", "", text, "reward",
             "the bearer token `relay judge` requires by default"),
    Variable("RELAY_USER_PATH", "user_path", "", text, "reward",
             "the directory user code (`module.func` flags) imports from (set by the launcher)"),
)
settings = Layer("reward", "launcher / you", VARIABLES)
