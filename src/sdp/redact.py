"""Keep credentials out of everything a run writes: config.yaml, checkpoints, logs, W&B.

A secret reaches a run in two ways: under a config key that names one
(`+dataset.hf_token=${oc.env:HF_TOKEN}`, `+logger.api_key=...`), or as a value
copied from a secret environment variable. Both are replaced by `<redacted>`:

- a *secret name* ends in TOKEN, SECRET, PASSWORD, PASSWD, PASSPHRASE, AUTH,
  AUTHORIZATION, CREDENTIAL(S), APIKEY or API/ACCESS/PRIVATE/SECRET_KEY
  (case-insensitive, any of `_ - .` or camelCase between words), e.g.
  WANDB_API_KEY, HF_TOKEN, AWS_SECRET_ACCESS_KEY, `hf_token`; matching the end
  only keeps `tokenizer`, `max_tokens` and HF_TOKEN_PATH (where a secret lives,
  not the secret) out; a tokenizer's special tokens (`eos_token`) are text;
- a *secret value* is the value (8 characters or more, so `1` or `true` never
  match) of an environment variable with a secret name.

Free text additionally loses `NAME=value` / `NAME: value` pairs with a secret
name (overrides and error messages echo them) and Hugging Face access tokens
(`hf_` and 34 letters or digits), which a user may paste anywhere.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

REDACTED = "<redacted>"
MIN_SECRET_LEN = 8

_SECRET_WORDS = {
    "token",
    "secret",
    "secrets",
    "password",
    "passwd",
    "passphrase",
    "auth",
    "authorization",
    "credential",
    "credentials",
    "apikey",
}
_SECRET_PAIRS = {("api", "key"), ("access", "key"), ("private", "key"), ("secret", "key")}
# A tokenizer's special tokens (eos_token: "<|endoftext|>") are vocabulary, not credentials.
_SPECIAL_TOKENS = {"bos", "eos", "pad", "unk", "sep", "cls", "mask"}

_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}")
_ASSIGNMENT = re.compile(r"(?P<name>[A-Za-z_][\w.+-]*)(?P<sep>['\"]?\s*[=:]\s*['\"]?)(?P<value>[^\s'\",}\]]+)")


def is_secret_name(name: object) -> bool:
    """Whether a config key or environment variable name says it holds a credential."""
    words = re.findall(r"[a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", str(name)).lower())
    if not words:
        return False
    if words[-1] == "token" and len(words) > 1 and words[-2] in _SPECIAL_TOKENS:
        return False
    return words[-1] in _SECRET_WORDS or tuple(words[-2:]) in _SECRET_PAIRS


def secret_values(environ: Mapping[str, str] = os.environ) -> set[str]:
    """The values of the environment's secret-named variables, 8 characters or longer."""
    return {value for name, value in environ.items() if is_secret_name(name) and len(value) >= MIN_SECRET_LEN}


def redact_text(text: str, secrets: set[str] | None = None) -> str:
    """`text` with secret values, secret-named assignments and HF tokens replaced by `<redacted>`."""
    secrets = secret_values() if secrets is None else secrets
    for value in sorted(secrets, key=len, reverse=True):  # longest first: one secret may contain another
        text = text.replace(value, REDACTED)
    text = _HF_TOKEN.sub(REDACTED, text)

    def hide(match: re.Match) -> str:
        if not is_secret_name(match["name"]) or match["value"].startswith(REDACTED):
            return match[0]
        return f"{match['name']}{match['sep']}{REDACTED}"

    return _ASSIGNMENT.sub(hide, text)


def redact(obj: object, secrets: set[str] | None = None) -> object:
    """A copy of nested dicts and lists (as `OmegaConf.to_container` gives) with every non-empty
    string under a secret-named key, and every secret inside other strings, replaced by
    `<redacted>`. Numbers, booleans and None are kept: they are flags and sizes, not credentials."""
    secrets = secret_values() if secrets is None else secrets
    return _redact(obj, secrets, hide=False)


def _redact(obj: object, secrets: set[str], *, hide: bool) -> object:
    if isinstance(obj, Mapping):
        return {key: _redact(value, secrets, hide=hide or is_secret_name(key)) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_redact(value, secrets, hide=hide) for value in obj)
    if isinstance(obj, str):
        return REDACTED if hide and obj else redact_text(obj, secrets)
    return obj
