"""What must never be published: secrets and local paths, found in text, JSON and YAML, replaced, and listed.

One rule set for every text a hub repo gets (``scripts.export.push_to_hub`` stages a card, an eval report and
a training config written on the user's machine). A secret is found by its shape (``sk-...``, ``hf_...``,
``AKIA...``, a JWT, a private key block, an ``Authorization`` header) or by the name it is given
(``api_key: ...``, ``HF_TOKEN=...``, a JSON or YAML key such as ``aws_secret_access_key``). A local path is
any path from the root, a home folder or a drive: ``/home/me``, ``~/x``, ``~user/x``, ``$HOME/x``,
``file:///x``, ``C:\\Users\\me``, ``\\\\server\\share``, also after ``key:`` and as a JSON or YAML key.
Each find is reported as (where, kind) with where a dotted key or ``line N``; the secret itself never is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import yaml

SECRET = "secret"
URL_CREDENTIAL = "credential in a URL"
LOCAL_PATH = "local path"
HIDDEN = "<redacted>"
PATH = "<local-path>"

# Names whose value is a secret, as a key (fullmatch) or before '=' / ':' in text. A bare "token" counts only
# alone: pad_token, eos_token and max_new_tokens name no secret.
_SECRET_WORDS = (
    r"api[_-]?key|apikey|client[_-]?secret|secret(?:[_-]?access)?(?:[_-]?key)?|passw(?:or)?d|private[_-]?key"
    r"|access[_-]?key(?:[_-]?id)?|credentials?|authorization"
    r"|(?:access|auth|api|hf|hub|bearer|refresh|session|github|gh|gitlab|wandb|openai|oauth|slack|personal)[_-]?token"
)
SECRET_NAME = re.compile(rf"(?:(?:[a-z0-9]+[_.-])*?(?:{_SECRET_WORDS})|token)", re.IGNORECASE)
_AWS_ID = r"\b(?:AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[A-Z0-9]{16}\b"
_PATH_CHARS = r"[^\s'\"`()<>\[\]{},;|*]"  # a path runs to the next space, quote, bracket or separator

Rule = tuple[str, re.Pattern[str], str | Callable[[re.Match[str]], str]]


def _aws_pair(match: re.Match[str]) -> str:
    # An AWS key id and, later on its line, its secret: 40 of base64's characters with upper, lower and digits
    # (a sha1 is lower hex). Only beside a key id: alone, such a run may be a path or an id of anything.
    secret = match.group(3)
    mixed = any(c.isupper() for c in secret) and any(c.islower() for c in secret) and any(c.isdigit() for c in secret)
    return HIDDEN + match.group(2) + (HIDDEN if mixed else secret)


# Applied in this order: the shapes first (so "HF_TOKEN=hf_..." is one find), then names, then paths; the
# private key block last, being the one find that spans lines (line numbers of the others stay right).
RULES: tuple[Rule, ...] = (
    (URL_CREDENTIAL, re.compile(r"(?<=://)[^\s/@'\"]+@"), f"{HIDDEN}@"),  # user:token@host
    (
        URL_CREDENTIAL,  # ?api_key=..., &token=..., &X-Amz-Signature=...
        re.compile(r"(?<=[?&])([\w.-]*(?:token|key|secret|passw|auth|sig)[\w.-]*=)[^&\s#'\"]+", re.IGNORECASE),
        rf"\1{HIDDEN}",
    ),
    (SECRET, re.compile(r"\bsk-[A-Za-z0-9_-]{20,}"), HIDDEN),  # OpenAI, Anthropic (sk-ant-...)
    (SECRET, re.compile(r"\bhf_[A-Za-z0-9]{30,}"), HIDDEN),  # Hugging Face
    (SECRET, re.compile(rf"({_AWS_ID})([^\n]*?)(?<![A-Za-z0-9/+=])([A-Za-z0-9/+]{{40}})(?![A-Za-z0-9/+=])"), _aws_pair),
    (SECRET, re.compile(_AWS_ID), HIDDEN),  # an AWS key id alone
    (SECRET, re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{36,}|github_pat_\w{22,})"), HIDDEN),  # GitHub
    (SECRET, re.compile(r"\bxox[abposr]-[A-Za-z0-9-]{10,}"), HIDDEN),  # Slack
    (SECRET, re.compile(r"\bAIza[0-9A-Za-z_-]{35}"), HIDDEN),  # Google
    (SECRET, re.compile(r"\beyJ[\w-]{10,}\.[\w-]{10,}\.[\w-]{10,}"), HIDDEN),  # a JWT
    (
        SECRET,  # an HTTP Authorization header, with or without its scheme; a bare "Bearer <token>"
        re.compile(r"(?i)(\bauthorization[\"']?\s*[:=]\s*[\"']?(?:(?:bearer|basic|token|digest)\s+)?)(?!<)[^\s\"',;]+"),
        rf"\1{HIDDEN}",
    ),
    (SECRET, re.compile(r"(?i)(\bbearer\s+)(?!<)[A-Za-z0-9._~+/=-]{8,}"), rf"\1{HIDDEN}"),
    (
        SECRET,  # name = value, name: value (HF_TOKEN=..., api_key: ..., "password": "...")
        re.compile(
            rf"(?<![\w.-])({SECRET_NAME.pattern}[\"']?\s*[:=]\s*[\"']?)"
            r"(?!<|(?:null|none|true|false)\b|(?:bearer|basic|token|digest)\s)[^\s\"',;&|)]{4,}",
            re.IGNORECASE,
        ),
        rf"\1{HIDDEN}",
    ),
    (LOCAL_PATH, re.compile(rf"(?i)\bfile://{_PATH_CHARS}*"), PATH),
    (LOCAL_PATH, re.compile(rf"(?<![\w\\])(?:[A-Za-z]:[\\/]|\\\\[\w.$-]+\\){_PATH_CHARS}*"), PATH),  # C:\, \\srv\
    (LOCAL_PATH, re.compile(rf"%(?:USERPROFILE|HOMEPATH|APPDATA|LOCALAPPDATA)%[\\/]{_PATH_CHARS}*", re.I), PATH),
    # From the root or a home folder: a '/' after no word, dot, '-' or '/' (so not host/v1, a/b, tokens/s or a
    # URL's slashes: "://" is kept by the (?!/)), then up to the next space, quote or bracket.
    (LOCAL_PATH, re.compile(rf"(?<![\w.~<>/\\$-])(?:~[\w.-]*|\$HOME|\$\{{HOME\}})?/(?!/){_PATH_CHARS}+"), PATH),
    (
        SECRET,
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|\Z)", re.DOTALL),
        HIDDEN,
    ),
)


def redact_text(text: str) -> tuple[str, list[tuple[int, str]]]:
    """``text`` with every RULES match replaced, and each find as (line number in ``text``, kind)."""
    found: list[tuple[int, str]] = []
    for kind, pattern, replacement in RULES:

        def replace(match: re.Match[str], kind: str = kind, replacement: Any = replacement, now: str = text) -> str:
            new = replacement(match) if callable(replacement) else match.expand(replacement)
            if new != match.group(0):
                found.append((now.count("\n", 0, match.start()) + 1, kind))
            return new

        text = pattern.sub(replace, text)
    return text, sorted(set(found))


def _kinds(text: str) -> tuple[str, list[str]]:
    """``text`` redacted, and the kinds found in it (each once, in RULES' order)."""
    text, found = redact_text(text)
    return text, list(dict.fromkeys(kind for _, kind in sorted(found, key=lambda f: _ORDER[f[1]])))


_ORDER = {kind: i for i, kind in enumerate(dict.fromkeys(kind for kind, _, _ in RULES))}


def redact_data(value: Any, key: str = "", found: list[tuple[str, str]] | None = None, secret: bool = False) -> Any:
    """A parsed JSON or YAML value with its strings and keys redacted, each find as (dotted key, kind) in
    ``found``; every scalar under a key SECRET_NAME matches (``secret``) is hidden whole."""
    found = [] if found is None else found
    if secret and isinstance(value, (str, int, float)) and not isinstance(value, bool) and value != "":
        found.append((key or "(the document)", SECRET))
        return HIDDEN
    if isinstance(value, str):
        value, kinds = _kinds(value)
        found += [(key or "(the document)", kind) for kind in kinds]
    elif isinstance(value, dict):
        out: dict[Any, Any] = {}
        for name, item in value.items():
            text, kinds = _kinds(name) if isinstance(name, str) else (name, [])
            while text in out:  # two paths redacted to one name: keep both values, numbered
                text = f"{text}-{len(out)}"
            where = f"{key}.{text}" if key else str(text)
            found += [(where, f"{kind} in a key") for kind in kinds]
            hidden = secret or (isinstance(name, str) and SECRET_NAME.fullmatch(name) is not None)
            out[text] = redact_data(item, where, found, hidden)
        value = out
    elif isinstance(value, list):
        value = [redact_data(v, f"{key}[{i}]", found, secret) for i, v in enumerate(value)]
    return value


def parsed(text: str, suffix: str) -> Any:
    """A JSON or YAML file's content; None for other text, or one that is not what its name says."""
    try:
        if suffix == ".json":
            return json.loads(text)
        return yaml.safe_load(text) if suffix in (".yaml", ".yml") else None
    except (ValueError, yaml.YAMLError):
        return None


def redact_document(text: str, suffix: str) -> tuple[str, list[tuple[str, str]]]:
    """A file's text redacted, and each find as (where, kind): JSON and YAML value by value (where is the
    dotted key), any other text as a whole (where is ``line N``). The text comes back unchanged when nothing
    was found."""
    data = parsed(text, suffix)
    if data is None:
        redacted, lines = redact_text(text)
        return (redacted if lines else text), [(f"line {line}", kind) for line, kind in lines]
    found: list[tuple[str, str]] = []
    data = redact_data(data, "", found)
    if not found:
        return text, []
    if suffix == ".json":
        return json.dumps(data, indent=2) + "\n", found
    return yaml.safe_dump(data, sort_keys=False), found
