"""Config base and loader shared by every tier.

Owns: the frozen, extra-forbidding pydantic base model, the sub-configs every
tier shares (etcd, logging), and :func:`load_config`, which applies the
precedence ``defaults < file (YAML/TOML) < LAMINAR_* env < --set a.b=c``.

Invariants: a config either validates completely or :class:`ConfigError` is
raised naming every bad field path with a hint; nothing half-loaded escapes.
A config holding both ``etcd`` and ``auth`` takes its etcd TLS files from
``auth.dir`` when it has them and ``etcd`` names none (see
:meth:`LaminarModel._etcd_tls_from_auth_dir`).
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import tomllib
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from laminar_common.errors import ConfigError

__all__ = [
    "PREFLIGHT_WARNING_PREFIX",
    "LaminarModel",
    "check_model_dir",
    "EtcdConfig",
    "LoggingConfig",
    "MetricsConfig",
    "AuthConfig",
    "HostConfig",
    "ListenConfig",
    "check_etcd_tls",
    "load_config",
    "read_config_file",
    "apply_override",
    "dump_config",
]

ENV_PREFIX = "LAMINAR_"
M = TypeVar("M", bound="LaminarModel")



def check_model_dir(value: str) -> str:
    """A model directory must exist and hold config.json when a config loads (a typo
    fails there, naming the field, not later as a Hugging Face "repo id" error). For a
    pydantic ``field_validator``: raises ValueError, returns ``value``."""
    try:
        found = (Path(value) / "config.json").is_file()
        what = "holds no config.json" if Path(value).is_dir() else "does not exist"
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte ...
        found, what = False, f"cannot be read ({exc.__class__.__name__})"
    if not found:
        raise ValueError(f"model directory {value!r} {what} (want a save_pretrained "
                         "directory: config.json, weights, tokenizer)")
    return value

class LaminarModel(BaseModel):
    """Base of every config model: immutable, and unknown keys are errors."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _etcd_tls_from_auth_dir(cls, data: Any) -> Any:
        """Fill ``etcd``'s TLS files from ``auth.dir``, so that one switch secures every channel.

        Applies to a model with ``etcd: EtcdConfig`` and ``auth: AuthConfig``
        fields (every tier's config), only when ``auth.dir`` holds
        ``etcd-ca.pem`` and ``etcd`` sets none of ``ca_cert`` / ``client_cert``
        / ``client_key`` (explicit etcd settings win, all three together).
        """
        fields = cls.model_fields
        if ("etcd" not in fields or "auth" not in fields or not isinstance(data, dict)
                or fields["etcd"].annotation is not EtcdConfig
                or fields["auth"].annotation is not AuthConfig):
            return data
        auth = data.get("auth")
        auth_dir = auth.dir if isinstance(auth, AuthConfig) else (
            auth.get("dir") if isinstance(auth, dict) else None)
        if not isinstance(auth_dir, (str, os.PathLike)):
            return data
        etcd = data.get("etcd", {})
        if isinstance(etcd, EtcdConfig):
            etcd = etcd.model_dump()
        if not isinstance(etcd, dict):
            return data
        from laminar_common.auth import etcd_tls_for

        try:
            tls = etcd_tls_for(auth_dir, etcd)
        except ConfigError as exc:
            raise ValueError(str(exc)) from exc
        if not tls:
            return data
        return {**data, "etcd": {**etcd, **tls}}


def check_etcd_tls(endpoints: Iterable[str], ca_cert: str | None, client_cert: str | None,
                   client_key: str | None) -> bool:
    """Whether etcd is reached over TLS; checks that endpoints and TLS files agree.

    TLS is on when ``ca_cert`` is set or the endpoints use ``https://``
    (without ``ca_cert`` the system's roots verify the server). A bare
    ``host:port`` follows ``ca_cert``; an explicit ``http://`` endpoint with
    TLS files, or a mix of ``http://`` and ``https://``, is refused.

    Raises:
        ValueError: naming the offending field (``etcd.endpoints``,
            ``etcd.client_cert`` ...) and what to do.
    """
    schemes = {}
    for endpoint in endpoints:
        scheme, sep, _ = endpoint.partition("://")
        if sep and scheme not in ("http", "https"):
            raise ValueError(f"etcd.endpoints: {endpoint!r} has scheme {scheme!r}; "
                             "use host:port, http://host:port or https://host:port")
        schemes[endpoint] = scheme if sep else None
    if (client_cert is None) != (client_key is None):
        have, missing = ("client_cert", "client_key") if client_key is None else (
            "client_key", "client_cert")
        raise ValueError(f"etcd.{have} is set but etcd.{missing} is not: set both "
                         "(mutual TLS to etcd) or neither")
    https = [e for e, s in schemes.items() if s == "https"]
    http = [e for e, s in schemes.items() if s == "http"]
    if https and http:
        raise ValueError(f"etcd.endpoints mixes TLS ({https[0]!r}) and plaintext ({http[0]!r}); "
                         "use one scheme for the whole cluster")
    tls = bool(https) or ca_cert is not None
    if http and (ca_cert is not None or client_cert is not None):
        raise ValueError(f"etcd.endpoints: {http[0]!r} is plaintext but etcd TLS files are set "
                         "(etcd.ca_cert / etcd.client_cert, given or taken from auth.dir); "
                         "use https:// or a bare host:port")
    if client_cert is not None and not tls:
        raise ValueError("etcd.client_cert is set but TLS to etcd is off: set etcd.ca_cert "
                         "or use https:// endpoints")
    return tls


class EtcdConfig(LaminarModel):
    """Where etcd is, how this member reaches it, and how it holds its lease."""

    endpoints: tuple[str, ...] = Field(default=("127.0.0.1:2379",), min_length=1)
    """etcd client endpoints as ``host:port`` (or ``http://`` / ``https://host:port``);
    the first reachable one is used. ``https://`` turns TLS on."""
    ttl_s: int = Field(default=10, ge=2, le=300)
    """Lease TTL in seconds: a member that stops refreshing vanishes after this."""
    connect_timeout_s: float = Field(default=30.0, gt=0)
    """How long to retry (with backoff) before giving up on reaching etcd."""
    user: str | None = None
    """etcd user name, if etcd authentication is on."""
    password: str | None = None
    """etcd password for ``user``."""
    ca_cert: str | None = None
    """Path of the CA certificate that signed etcd's server certificate; setting it turns
    TLS to etcd on. Unset: taken from ``auth.dir``'s ``etcd-ca.pem`` when there is one."""
    client_cert: str | None = None
    """Path of this member's client certificate, for an etcd run with
    ``--client-cert-auth`` (mutual TLS); set together with ``client_key``."""
    client_key: str | None = None
    """Path of the private key of ``client_cert``."""

    @model_validator(mode="after")
    def _check_tls(self) -> EtcdConfig:
        check_etcd_tls(self.endpoints, self.ca_cert, self.client_cert, self.client_key)
        return self


class MetricsConfig(LaminarModel):
    """The Prometheus endpoint of a tier process."""

    port: int | None = Field(default=None, ge=0, le=65535)
    """Port of /metrics (0: any free port, advertised in etcd); unset: no endpoint."""
    host: str = "127.0.0.1"
    """Interface /metrics listens on (the default is this machine's own: set the host's
    address, or ``0.0.0.0`` for every interface, for a scraper on another machine; the
    URL in etcd then names the member's advertised address)."""


class AuthConfig(LaminarModel):
    """Authentication of every channel (off for local runs)."""

    dir: str | None = None
    """Directory written by `laminar keys`: when set, ZeroMQ sockets use CURVE (only
    authorized client keys connect) and the relay's gRPC uses TLS; when it also holds
    ``etcd-ca.pem`` (``laminar keys --etcd``), etcd is reached over TLS, with the
    ``etcd-client.pem`` client certificate when there is one."""
    mutual_tls: bool = True
    """gRPC: require client certificates (mutual TLS), so a relay knows who calls: only
    the trainer's ``publisher.pem`` (and relays' own certificate) may publish. False
    leaves server-only TLS, where anyone holding the CA may publish."""
    insecure: bool = False
    """``laminar up`` refuses a job that spans hosts without ``auth.dir``; writing
    ``auth: {insecure: true}`` runs it anyway (warned loudly): anyone who can reach a
    socket may then push trajectories or publish weights."""

    @model_validator(mode="after")
    def _dir_or_insecure(self) -> AuthConfig:
        if self.dir is not None and self.insecure:
            raise ValueError("auth.insecure: true contradicts auth.dir (authentication on); "
                             "set one of them")
        return self

    def curve(self):
        """The job's CURVE keys, or None when authentication is off."""
        if self.dir is None:
            return None
        from laminar_common.auth import CurveAuth

        return CurveAuth.from_dir(self.dir)


class HostConfig(LaminarModel):
    """Base of a tier config: which host this member is on (for same-host decisions)."""

    host_id: str | None = Field(default=None, min_length=1, pattern=r"^\S+$")
    """This machine's identity in member records: members with equal host ids share
    memory (a worker maps its relay's weights instead of copying them). Default: the
    machine id (``/etc/machine-id``); set it where that is not unique per machine (cloned
    images) or to split one machine into emulated hosts. Never the host name."""

    @property
    def host(self) -> str:
        """The resolved host identity."""
        from laminar_common.net import host_identity

        return host_identity(self.host_id)


class ListenConfig(HostConfig):
    """Base of the config of a tier that listens: where it binds and what it advertises."""

    bind_host: str | None = None
    """Interface its sockets bind. Default: the advertised address only (never every
    interface unless asked): ``0.0.0.0`` / ``::`` binds all."""
    advertise_host: str | None = None
    """Address peers are told (etcd member record). Default: ``bind_host`` when that is a
    specific address, else the local address of the interface that routes to the etcd
    endpoint (127.0.0.1 with a local etcd). A loopback address while etcd is on another
    host is refused."""

    @model_validator(mode="after")
    def _no_loopback_advertisement(self) -> ListenConfig:
        from laminar_common.net import is_wildcard, resolve_listen

        etcd = getattr(self, "etcd", None)
        explicit = self.advertise_host or (
            None if self.bind_host is None or is_wildcard(self.bind_host) else self.bind_host)
        if etcd is not None and explicit is not None:
            try:
                resolve_listen(self.bind_host, self.advertise_host, etcd.endpoints)
            except ConfigError as exc:
                raise ValueError(str(exc)) from exc
        return self

    def addresses(self):
        """Resolve bind and advertised addresses (:func:`laminar_common.net.resolve_listen`)."""
        from laminar_common.net import resolve_listen

        return resolve_listen(self.bind_host, self.advertise_host, self.etcd.endpoints)


class LoggingConfig(LaminarModel):
    """How the CLI configures logging (libraries only ever get a logger)."""

    level: str = Field(default="INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")
    """Root log level: DEBUG, INFO, WARNING or ERROR."""
    json_format: bool = False
    """Emit one JSON object per line instead of text."""


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} cannot be read as UTF-8 text: {exc}") from exc
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"config file {str(p)!r}: use a .yaml, .yml or .toml file")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"config file {str(p)!r} is not valid: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return data


def apply_override(data: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    """Set ``data[a][b][c] = value`` for ``dotted == 'a.b.c'``, creating levels."""
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError(f"{source}: {dotted!r} is not a dotted field path like a.b.c")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"{source}: {where} is a value, not a section; cannot set {dotted}")
        node = child
    node[parts[-1]] = value


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


TIER_FIELD_NAMES = frozenset({
    "ack_listen", "ack_port", "activation_checkpointing", "advertise_host", "auth",
    "batch_groups", "bind_host", "buffer", "chain", "checkpoint", "data", "device", "dtype",
    "engine", "environment", "epochs", "etcd", "eval", "fetch_timeout_s", "final_dir",
    "group_size", "grpc_port", "grpc_workers", "host_id", "job", "kv_fetch_timeout_s",
    "kv_hold_max_mb", "kv_hold_s", "kv_listen", "kv_plane", "kv_port", "kv_transfer_max_mb",
    "lease_grace_s", "ledger_keep_groups", "listen", "logging", "loss", "manager_id",
    "max_fetch_wait_s", "max_prompts", "on_data_exhausted", "max_rejections", "max_staleness",
    "max_unpublished_steps", "max_waiting",
    "member_id", "metrics", "mode", "model_dir", "optim", "outbox_capacity", "port", "prompts",
    "protocol_version", "publish_delta_full_every", "publish_dtype", "publish_every",
    "records", "refill_fraction", "relay", "repack", "report_interval_s", "resend_after_s", "reward",
    "reward_timeout_s", "reward_workers", "role", "run_dir", "samples", "sampling", "seed",
    "simulate", "state_dir", "stats_path", "store", "temperature", "threads", "total_steps",
    "tracking", "trainer_id", "wait_timeout_s", "weight_load_timeout_s", "worker_id",
    "worker_timeout_s"
})
"""Every top-level config field of Laminar's tiers (relay, manager, worker, trainer, and
``laminar member``): one environment serves every tier, so a ``LAMINAR_*`` variable that
names another tier's field is not a typo. Each tier's tests check that its configs' fields
are all here."""


def _warn_near_miss(model: type[BaseModel], dotted: str, source: str, prefix: str) -> None:
    """An env variable that sets no field of ``model`` but nearly names one (a typo such as
    ``LAMINAR_TOTAL_STEP``) is said on stderr (with the preflight prefix, so ``laminar up``
    shows it); other ``LAMINAR_*`` variables (another tier's fields, the CLIs' option
    variables) are left alone, as one environment serves every tier."""
    head = dotted.split(".")[0]
    if head in TIER_FIELD_NAMES:
        return
    close = difflib.get_close_matches(head, list(model.model_fields), n=1, cutoff=0.8)
    if not close:
        return
    name = source.removeprefix("env ")
    fixed = prefix + dotted.replace(head, close[0], 1).replace(".", "__").upper()
    print(f"{PREFLIGHT_WARNING_PREFIX}{name} sets no {model.__name__} field and is ignored: "
          f"did you mean {fixed}?", file=sys.stderr, flush=True)


def _env_overrides(env: Mapping[str, str], prefix: str) -> list[tuple[str, Any, str]]:
    out = []
    for name, raw in sorted(env.items()):
        if not name.startswith(prefix) or name == f"{prefix}CONFIG":
            continue
        dotted = name[len(prefix):].lower().replace("__", ".")
        out.append((dotted, _parse_scalar(raw), f"env {name}"))
    return out


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """Field names that exist at ``loc`` (best effort, for did-you-mean hints)."""
    current: Any = model
    for part in loc:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        ann = fields[part].annotation
        current = ann if isinstance(ann, type) else None
        if current is None:
            return []
    fields = getattr(current, "model_fields", None)
    return list(fields) if fields else []


def _path_text(loc: tuple[Any, ...]) -> str:
    """``a.b.0``; a key that is empty or could be misread (``.``, ``:``, blanks, ``<root>``)
    is quoted."""

    def part(p: Any) -> str:
        if isinstance(p, int):
            return str(p)
        plain = (isinstance(p, str) and p.isprintable() and p and p != "<root>"
                 and not any(c in p for c in ".: "))
        return p if plain else repr(p)

    return ".".join(part(p) for p in loc) or "<root>"


def _format_errors(model: type[BaseModel], exc: ValidationError, origin: str) -> str:
    lines = [f"invalid {model.__name__} ({origin}):"]
    for err in exc.errors():
        loc = tuple(p for p in err["loc"])
        path = _path_text(loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            known = _field_names(model, loc[:-1])
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            valid = f"; valid fields here: {', '.join(known)}" if known else ""
            lines.append(f"  {path}: unknown field{hint}{valid}")
        else:
            given = err.get("input")
            shown = "" if isinstance(given, dict) else f" (got {given!r})"
            lines.append(f"  {path}: {msg}{shown}")
    return "\n".join(lines)


def load_config(
    model: type[M],
    path: str | os.PathLike[str] | None = None,
    overrides: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    env_prefix: str = ENV_PREFIX,
    base: Mapping[str, Any] | None = None,
) -> M:
    """Build a validated config of type ``model``.

    Args:
        model: the tier's config class.
        path: optional YAML/TOML file.
        overrides: ``a.b=c`` strings (``--set``); values are parsed as YAML
            scalars, so ``3`` is an int and ``[a, b]`` a list.
        env: environment to read ``LAMINAR_A__B=c`` from (``os.environ`` by default).
        base: values applied below the file (e.g. a section of a job file).

    Raises:
        ConfigError: unreadable file, bad override syntax, or any field that
            does not validate (every bad field path is listed).
    """
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        for key, value in read_config_file(path).items():
            data[key] = value
    for dotted, value, source in _env_overrides(os.environ if env is None else env, env_prefix):
        if dotted.split(".")[0] in model.model_fields:
            apply_override(data, dotted, value, source)
        else:
            _warn_near_miss(model, dotted, source, env_prefix)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected a.b=value")
        dotted, raw = item.split("=", 1)
        apply_override(data, dotted.strip(), _parse_scalar(raw), f"--set {item!r}")
    origin = f"file {str(path)!r}" if path is not None else "defaults and overrides"
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_errors(model, exc, origin)) from exc


def log_resolved(logger: Any, config: BaseModel, path: str | os.PathLike[str] | None) -> None:
    """Record a tier's resolved config at its start: beside its ``--config`` file as
    ``<name>.resolved.yaml`` (one log line names it; the log starts with what the tier
    does, not ~50 lines of settings), or in the log where no file was given."""
    if path is None:
        logger.info("resolved config:\n%s", dump_config(config))
        return
    src = Path(path)
    out = src.with_name(f"{src.stem}.resolved.yaml")
    try:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(dump_config(config) + "\n")
        os.replace(tmp, out)
    except OSError as exc:
        logger.info("resolved config (not written to %s: %s):\n%s", out, exc,
                    dump_config(config))
        return
    logger.info("resolved config: %s", out)


def dump_config(config: BaseModel) -> str:
    """Render the resolved config as YAML (secrets masked) for the start-up log."""
    data = config.model_dump(mode="json")

    def mask(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: ("***" if k in ("password", "secret_key") and v else mask(v))
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [mask(v) for v in node]
        return node

    return yaml.safe_dump(mask(data), sort_keys=False).rstrip()


PREFLIGHT_WARNING_PREFIX = "laminar-preflight WARNING: "
"""A line a tier's config check (``--print-config``) prints with this prefix is shown on
``laminar up``'s console even when the check passes: what a user must know that does not
stop the job."""
