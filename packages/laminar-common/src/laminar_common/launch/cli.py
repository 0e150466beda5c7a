"""The ``laminar`` command: local etcd, the membership demo, a probe member, status.

A click group. Arguments are parsed first and the heavier modules imported
only inside the command bodies, so ``--help`` and shell completion are
instant. Logging is configured here, once.

Environment:
    * Every option can also come from ``LAMINAR_<COMMAND>_<OPTION>`` (click's
      ``auto_envvar_prefix``; ``--help`` names each one), e.g.
      ``LAMINAR_STATUS_JOB=demo laminar status``. The command line wins.
      ``--set`` is command-line only.
    * ``laminar member``'s config fields come from ``LAMINAR_A__B=c`` as in
      every tier (:func:`laminar_common.config.load_config`: defaults < file <
      ``LAMINAR_*`` env < ``--set``). No option's variable names a config
      field, so the two never collide. ``laminar up`` reads its job file
      without the environment; the tiers it starts inherit it.
    * ``LAMINAR_ETCD_BIN`` picks the etcd binary (``laminar etcd``, ``laminar up``).

Shell completion (bash; ``zsh_source`` and ``fish_source`` likewise)::

    eval "$(_LAMINAR_COMPLETE=bash_source laminar)"

Exit codes: 0 success, 1 a run failed (``laminar up``: a tier failed or
exited early; its log's tail is printed), 2 bad arguments, an invalid job
file or tier config, or another :class:`~laminar_common.errors.LaminarError`
(printed as ``laminar CMD: error: ...``); ``laminar up`` also 124 (the job's
``timeout_s``) and 130 (interrupted).
"""

from __future__ import annotations

import sys

import click

from laminar_common import clitools

__all__ = ["main", "cli"]

_CONTEXT = clitools.context("LAMINAR")
_option = clitools.option


class _LaminarGroup(click.Group):
    """Reports a LaminarError from any command as one line and exit code 2."""

    def invoke(self, ctx: click.Context):
        from laminar_common.errors import LaminarError

        try:
            return super().invoke(ctx)
        except LaminarError as exc:
            print(f"laminar {ctx.invoked_subcommand}: error: {exc}", file=sys.stderr)
            return 2


@click.group(cls=_LaminarGroup, context_settings=_CONTEXT, help="Laminar shared tooling.")
def cli() -> None:
    """The ``laminar`` group; each command imports what it needs when it runs."""


def _overrides(what: str):
    return click.option("--set", "overrides", multiple=True, metavar="A.B=C",
                        allow_from_autoenv=False,
                        help=f"override a {what} field (repeatable)")


@cli.command(help="Run a local etcd on a free loopback port until Ctrl-C.")
@_option("--data-dir", type=click.Path(), help="data dir (default: a new temp dir)")
@_option("--port", type=int, help="client port (default: a free one)")
@_option("--auth-dir", metavar="DIR", type=click.Path(),
              help="serve https:// with DIR's etcd-*.pem (from `laminar keys --etcd`), "
                   "requiring client certificates when DIR has etcd-client.pem")
def etcd(data_dir: str | None, port: int | None, auth_dir: str | None) -> int:
    import signal
    import threading

    from laminar_common.launch.local_etcd import LocalEtcd
    from laminar_common.logs import setup_logging

    setup_logging("INFO")
    mutual = False
    if auth_dir:
        from laminar_common.auth import etcd_tls_paths

        mutual = "client_cert" in etcd_tls_paths(auth_dir)
    server = LocalEtcd(data_dir=data_dir, port=port, tls_dir=auth_dir,
                       client_cert_auth=mutual).start()
    print(f"etcd listening on {server.endpoint} (data dir {server.data_dir}); Ctrl-C stops it",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        if server.proc is None or server.proc.poll() is not None:
            print("etcd exited", file=sys.stderr)
            return 1
    server.close()
    return 0


@cli.command(help="Run a probe member (registers, serves a sink). Config precedence: "
                  "defaults < --config file < LAMINAR_A__B=c env vars < --set a.b=c.")
@clitools.config_option()
@_overrides("config")
def member(config: str | None, overrides: tuple[str, ...]) -> int:
    import logging

    from laminar_common.config import dump_config, load_config
    from laminar_common.launch.member import MemberConfig, MemberService
    from laminar_common.logs import setup_logging

    resolved = load_config(MemberConfig, config, overrides)
    setup_logging(resolved.logging.level, resolved.job, resolved.member_id,
                  resolved.logging.json_format)
    logging.getLogger("laminar_common.launch.cli").info("resolved config:\n%s", dump_config(resolved))
    return MemberService(resolved).run_forever()


@cli.command(help="Membership demo: etcd, members, SIGKILL, etcd restart.")
@_option("--members", type=int, default=3, help="number of probe members")
@_option("--ttl", type=int, default=3, help="lease TTL in seconds")
def demo(members: int, ttl: int) -> int:
    from laminar_common.launch.demo import run_demo
    from laminar_common.logs import setup_logging

    setup_logging("WARNING")
    return run_demo(members, ttl)


@cli.command(help="Start a whole stack from a job file (YAML or TOML): check every tier's "
                  "config, set up, start etcd and the tiers; a tier that exits early stops "
                  "the stack. Each launch is a new run in the job's run_dir.",
             short_help="Start a whole stack from a job file (YAML or TOML).")
@click.argument("job", type=click.Path())
@_overrides("job-file")
@_option("--backend", type=click.Choice(["local", "ray"]), default="local",
              help="local subprocesses or Ray actors")
@_option("--address", "--ray-address", "ray_address", default=None,
              help="Ray cluster address, e.g. HEAD_IP:6379 (default: start a local Ray)")
@_option("--num-cpus", type=int, default=None, help="CPUs of a local Ray")
@_option("--resume", is_flag=True, default=False,
         help="go on with the run in run_dir: the trainer from its latest checkpoint, the "
              "manager from its saved ledger (every tier's --resume)")
@_option("--fresh", is_flag=True, default=False,
         help="start a new run where run_dir holds an earlier one's checkpoints (removes them)")
def up(job: str, overrides: tuple[str, ...], backend: str, ray_address: str | None,
       num_cpus: int | None, resume: bool, fresh: bool) -> int:
    from laminar_common.launch.up import run_job
    from laminar_common.logs import setup_logging

    if resume and fresh:
        raise click.UsageError("--resume and --fresh exclude each other")
    setup_logging("WARNING")
    return run_job(job, list(overrides), backend, ray_address, num_cpus,
                   start="resume" if resume else "fresh" if fresh else "new")


@cli.command(help="Summarize a trainer run (RUN_DIR: the trainer's run_dir) and plot its metrics.",
             short_help="Summarize a trainer run dir and plot its metrics.")
@click.argument("run_dir", type=click.Path())
def report(run_dir: str) -> int:
    from laminar_common.launch.report import find_worker_stats, load_metrics, summarize, write_plots

    rows, summary = load_metrics(run_dir)
    print(summarize(rows, summary))
    plots = write_plots(rows, summary, run_dir, workers=find_worker_stats(run_dir))
    print(f"metrics: {run_dir}/metrics.jsonl")
    print("plots: " + (", ".join(map(str, plots)) if plots else
                       "none (pip install 'laminar-common[report]' for matplotlib)"))
    return 0


@cli.command(help="Show what a run's steps trained on, from the trainer's step records "
                  "(RUN_DIR: the job's or the trainer's run directory): prompts, "
                  "completions, rewards, versions, staleness. Default: the newest step.",
             short_help="Show what a run's steps trained on.")
@click.argument("run_dir", type=click.Path(exists=True))
@_option("--step", type=int, default=None, help="this step (default: the newest recorded)")
@_option("--worst", "order", flag_value="worst", help="lowest rewards first")
@_option("--best", "order", flag_value="best", help="highest rewards first")
@_option("--longest", "order", flag_value="longest", help="longest responses first")
@_option("--count", "-n", type=int, default=8, show_default=True,
              help="trajectories shown")
@_option("--width", type=int, default=400, show_default=True,
              help="characters of each prompt and completion shown")
def samples(run_dir: str, step: int | None, order: str | None, count: int, width: int) -> int:
    from laminar_common.data.provenance import show_samples
    from laminar_common.errors import LaminarError

    try:
        print(show_samples(run_dir, step, order, count, width))
    except LaminarError as exc:
        raise click.ClickException(str(exc)) from exc
    return 0


@cli.command(help="Recompute a step of a run from the checkpoint before it and its record "
                  "and compare it with the checkpoint after it (--step N; bit-exact on the "
                  "same machine and environment), or generate a seeded trajectory again "
                  "(--trajectory ID, torch engine). Without either: the replayable steps. "
                  "Runs laminar-trainer replay / laminar_rollout.regenerate (those packages "
                  "must be installed here).",
             short_help="Recompute a step, or regenerate a trajectory.")
@click.argument("run_dir", type=click.Path(exists=True))
@_option("--step", type=int, default=None, help="the step to recompute")
@_option("--trajectory", default=None, help="a trajectory id to generate again")
@_option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32",
              help="with --trajectory: the rollout engine's dtype")
def replay(run_dir: str, step: int | None, trajectory: str | None, dtype: str) -> int:
    import importlib.util
    import subprocess
    import sys

    if trajectory is not None and step is not None:
        raise click.UsageError("give --step or --trajectory, not both")
    if trajectory is not None:
        module, args = "laminar_rollout.regenerate", ["--trajectory", trajectory, "--dtype", dtype]
    else:
        module, args = "laminar_trainer.replay", ["--step", str(step)] if step is not None else []
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise click.ClickException(f"{module.split('.')[0]} is not installed in this "
                                   f"environment (pip install {module.split('.')[0].replace('_', '-')})")
    return subprocess.call([sys.executable, "-m", module, run_dir, *args])


@cli.command(help="Create CURVE keys and TLS certificates for a job.")
@_option("--out", required=True, type=click.Path(),
              help="output directory (auth.dir of every tier)")
@_option("--etcd", is_flag=True,
              help="also write an etcd CA, server and client certificate (etcd-*.pem): "
                   "with them in auth.dir every tier reaches etcd over mutual TLS")
@_option("--etcd-host", multiple=True, metavar="HOST",
              help="a DNS name or IP the etcd server certificate must name, besides "
                   "127.0.0.1 and localhost (repeatable; implies --etcd)")
@_option("--host", "hosts", multiple=True, metavar="HOST",
              help="a DNS name or IP a relay advertises: the relays' certificate names it "
                   "besides 127.0.0.1 and localhost (repeatable; every relay host of a cluster)")
@_option("--split", is_flag=True,
              help="also write OUT/trainer, OUT/relay and OUT/rollout, each holding only what "
                   "that tier needs (only OUT/trainer holds the publisher certificate)")
def keys(out: str, etcd: bool, etcd_host: tuple[str, ...], hosts: tuple[str, ...],
         split: bool) -> int:
    from laminar_common.auth import create_keys, split_keys

    with_etcd = etcd or bool(etcd_host)
    written = create_keys(out, etcd_hosts=list(etcd_host) if with_etcd else None,
                          hosts=list(hosts))
    print(f"wrote CURVE keys and TLS certificates to {written}; set auth.dir={written} "
          "in every tier's config")
    if split:
        for tier, d in split_keys(written, written).items():
            print(f"  {tier}: auth.dir={d}")
    if with_etcd:
        print(f"etcd: run it with --cert-file {written}/etcd-server.pem --key-file "
              f"{written}/etcd-server-key.pem --trusted-ca-file {written}/etcd-ca.pem "
              "--client-cert-auth and https:// client URLs")
    return 0


def _metrics_url(advertised: str | None, member_host: str) -> str:
    """A member's ``Extra.METRICS`` as a URL to scrape from elsewhere (``-``: none).

    A member advertises ``http://{metrics.host}:{port}/metrics``; on a wildcard
    interface (``0.0.0.0``, ``::``) its host name is put in instead, and an IPv6
    literal gets its brackets.
    """
    if not advertised:
        return "-"
    scheme, sep, rest = advertised.partition("://")
    if not sep:  # a bare host:port
        scheme, rest = "http", f"{advertised}/metrics"
    netloc, _, path = rest.partition("/")
    host, colon, port = netloc.rpartition(":")
    if not colon or not port.isdigit():
        return advertised
    host = host.strip("[]")
    if host in ("", "0.0.0.0", "::"):
        host = member_host
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}/{path}"


@cli.command(help="Show a job's members (with their /metrics URLs) and latest weight version: "
                  "RUN_DIR (a `laminar up` run dir: its etcd and job), or --etcd and --job.")
@click.argument("run_dir", required=False, type=click.Path())
@_option("--etcd", default=None,
              help="etcd endpoint host:port, or https://host:port (etcd.endpoints); "
                   "default: RUN_DIR's, else 127.0.0.1:2379")
@_option("--job", default=None, help="job name (default: RUN_DIR's)")
@_option("--auth-dir", metavar="DIR", type=click.Path(),
              help="take the etcd TLS files from DIR as a tier's auth.dir does "
                   "(etcd-ca.pem, etcd-client.pem, etcd-client-key.pem); a DIR without "
                   "etcd-ca.pem leaves etcd plaintext")
@_option("--etcd-ca", metavar="PEM", type=click.Path(),
              help="CA of etcd's server certificate; turns TLS on (etcd.ca_cert)")
@_option("--etcd-cert", metavar="PEM", type=click.Path(),
              help="client certificate for mutual TLS (etcd.client_cert)")
@_option("--etcd-key", metavar="PEM", type=click.Path(),
              help="key of --etcd-cert (etcd.client_key)")
def status(run_dir: str | None, etcd: str | None, job: str | None, auth_dir: str | None,
           etcd_ca: str | None, etcd_cert: str | None, etcd_key: str | None) -> int:
    import json

    from laminar_common.auth import etcd_tls_for
    from laminar_common.etcd import EtcdCoordinator
    from laminar_common.logs import setup_logging
    from laminar_common.roles import Extra, State, is_ready

    setup_logging("WARNING")
    if run_dir is not None:
        from pathlib import Path

        from laminar_common.launch.rundir import STAMP_NAME

        stamp_path = Path(run_dir) / STAMP_NAME
        try:
            stamp = json.loads(stamp_path.read_text())
        except (OSError, ValueError) as exc:
            raise click.UsageError(f"{stamp_path}: not a laminar up run dir ({exc})") from exc
        if not stamp.get("etcd"):
            raise click.UsageError(f"{stamp_path}: this launch has not started its etcd "
                                   "(or predates `laminar status RUN_DIR`): give --etcd")
        etcd = etcd or stamp["etcd"][0]
        job = job or stamp["job"]
        auth_dir = auth_dir or stamp.get("etcd_tls_dir")
    if job is None:
        raise click.UsageError("give RUN_DIR or --job")
    etcd = etcd or "127.0.0.1:2379"
    tls = {"ca_cert": etcd_ca, "client_cert": etcd_cert, "client_key": etcd_key}
    tls.update(etcd_tls_for(auth_dir, tls))  # the tiers' rule
    coord = EtcdCoordinator([etcd], job, connect_timeout_s=5, **tls)
    try:
        latest = coord.latest_version()
        print(f"job {job}: latest weight version {latest.version if latest else 'none'}")
        print("members:")
        for member_id, rec in sorted(coord.members().items(), key=lambda x: (x[1].role, x[0])):
            print(f"  {rec.role:<8} {member_id:<20} {rec.address:<28} host={rec.host} "
                  f"pkg={rec.package_version} proto={rec.protocol_version} "
                  f"ready={'yes' if is_ready(rec.extra) else 'no'} "
                  f"metrics={_metrics_url(rec.extra.get(Extra.METRICS), rec.host)}")
        trainer = coord.get_state(State.TRAINER)
        if trainer:
            t = json.loads(trainer)
            if "waiting_for" in t:
                print(f"trainer: step {t['step']}/{t['total_steps']} v{t['version']}, "
                      f"WAITING {t['waiting_s']}s for data: {t['waiting_for']}")
            else:
                print(f"trainer: step {t['step']}/{t['total_steps']} v{t['version']} "
                      f"reward {t['reward_mean']:.3f} tokens/s {t['tokens_per_s']:.1f} "
                      f"staleness mean {t['staleness_mean']:.2f} max {t['staleness_max']} "
                      f"buffer {t['buffer']}")
        manager = coord.get_state(State.MANAGER)
        if manager:
            m = json.loads(manager)
            print(f"manager: ledger {m['ledger']}, repacks {m['repacks']}, "
                  f"workers lost {m['workers_lost']}"
                  + (", PROMPTS EXHAUSTED" if m.get("prompts_exhausted") else "")
                  + (", holding new work for the resumed weights"
                     if m.get("holding_for_resume") else ""))
            for wid, w in sorted(m["workers"].items()):
                print(f"  {wid:<20} v{w['version']:<4} active {w['active']}/{w['capacity']} "
                      f"assigned {w['assigned']} kv {w['kv_used']}")
    finally:
        coord.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """``laminar`` on ``argv`` (default ``sys.argv[1:]``): its exit code (:func:`clitools.run`)."""
    return clitools.run(cli, argv, "laminar")


if __name__ == "__main__":
    sys.exit(main())
