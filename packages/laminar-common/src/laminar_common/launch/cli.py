"""The ``laminar`` command: local etcd, the membership demo, a probe member, status.

Parses arguments first and imports the heavier modules only afterwards, so
``--help`` is instant. Logging is configured here, once.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="laminar", description="Laminar shared tooling.")
    sub = p.add_subparsers(dest="cmd", required=True)

    e = sub.add_parser("etcd", help="run a local etcd on a free loopback port until Ctrl-C")
    e.add_argument("--data-dir", help="data dir (default: a new temp dir)")
    e.add_argument("--port", type=int, help="client port (default: a free one)")
    e.add_argument("--auth-dir", metavar="DIR",
                   help="serve https:// with DIR's etcd-*.pem (from `laminar keys --etcd`), "
                        "requiring client certificates when DIR has etcd-client.pem")

    m = sub.add_parser("member", help="run a probe member (registers, serves a sink)")
    m.add_argument("--config", help="YAML or TOML config file")
    m.add_argument("--set", action="append", default=[], metavar="A.B=C",
                   help="override a config field (repeatable)")

    d = sub.add_parser("demo", help="membership demo: etcd, members, SIGKILL, etcd restart")
    d.add_argument("--members", type=int, default=3, help="number of probe members")
    d.add_argument("--ttl", type=int, default=3, help="lease TTL in seconds")

    u = sub.add_parser("up", help="start a whole stack from a job file")
    u.add_argument("job", help="job file (YAML or TOML)")
    u.add_argument("--set", action="append", default=[], metavar="A.B=C",
                   help="override a job-file field (repeatable)")
    u.add_argument("--backend", choices=("local", "ray"), default="local",
                   help="local subprocesses or Ray actors")
    u.add_argument("--ray-address", default=None,
                   help="Ray cluster address (default: start a local Ray)")
    u.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray")

    r = sub.add_parser("report", help="summarize a trainer run dir and plot its metrics")
    r.add_argument("run_dir", help="the trainer's run_dir")

    pr = sub.add_parser("prompts", help="write synthetic-task prompt records (JSONL)")
    pr.add_argument("--task", default="sort", help="sort, reverse or add")
    pr.add_argument("--n", type=int, default=1000, help="number of records")
    pr.add_argument("--split", choices=("train", "eval"), default="train", help="split")
    pr.add_argument("--seed", type=int, default=0, help="seed")
    pr.add_argument("--out", required=True, help="output .jsonl path")
    pr.add_argument("--difficulty", action="append", default=[], metavar="KEY=INT",
                    help="task difficulty override, e.g. max_len=6 (repeatable)")

    k = sub.add_parser("keys", help="create CURVE keys and TLS certificates for a job")
    k.add_argument("--out", required=True, help="output directory (auth.dir of every tier)")
    k.add_argument("--etcd", action="store_true",
                   help="also write an etcd CA, server and client certificate (etcd-*.pem): "
                        "with them in auth.dir every tier reaches etcd over mutual TLS")
    k.add_argument("--etcd-host", action="append", default=[], metavar="HOST",
                   help="a DNS name or IP the etcd server certificate must name, besides "
                        "127.0.0.1 and localhost (repeatable; implies --etcd)")

    s = sub.add_parser("status", help="show a job's members and latest weight version")
    s.add_argument("--etcd", default="127.0.0.1:2379",
                   help="etcd endpoint host:port, or https://host:port (etcd.endpoints)")
    s.add_argument("--job", required=True, help="job name")
    s.add_argument("--auth-dir", metavar="DIR",
                   help="take the etcd TLS files from DIR as a tier's auth.dir does "
                        "(etcd-ca.pem, etcd-client.pem, etcd-client-key.pem); a DIR without "
                        "etcd-ca.pem leaves etcd plaintext")
    s.add_argument("--etcd-ca", metavar="PEM",
                   help="CA of etcd's server certificate; turns TLS on (etcd.ca_cert)")
    s.add_argument("--etcd-cert", metavar="PEM",
                   help="client certificate for mutual TLS (etcd.client_cert)")
    s.add_argument("--etcd-key", metavar="PEM", help="key of --etcd-cert (etcd.client_key)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from laminar_common.errors import LaminarError
    from laminar_common.logs import setup_logging

    try:
        if args.cmd == "etcd":
            return _cmd_etcd(args, setup_logging)
        if args.cmd == "member":
            return _cmd_member(args, setup_logging)
        if args.cmd == "demo":
            setup_logging("WARNING")
            from laminar_common.launch.demo import run_demo

            return run_demo(args.members, args.ttl)
        if args.cmd == "up":
            setup_logging("WARNING")
            from laminar_common.launch.up import run_job

            return run_job(args.job, args.set, args.backend, args.ray_address, args.num_cpus)
        if args.cmd == "report":
            return _cmd_report(args)
        if args.cmd == "prompts":
            return _cmd_prompts(args)
        if args.cmd == "keys":
            from laminar_common.auth import create_keys

            etcd = args.etcd or bool(args.etcd_host)
            out = create_keys(args.out, etcd_hosts=args.etcd_host if etcd else None)
            print(f"wrote CURVE keys and TLS certificates to {out}; set auth.dir={out} "
                  "in every tier's config")
            if etcd:
                print(f"etcd: run it with --cert-file {out}/etcd-server.pem --key-file "
                      f"{out}/etcd-server-key.pem --trusted-ca-file {out}/etcd-ca.pem "
                      "--client-cert-auth and https:// client URLs")
            return 0
        if args.cmd == "status":
            setup_logging("WARNING")
            return _cmd_status(args)
    except LaminarError as exc:
        print(f"laminar {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    return 2


def _cmd_etcd(args, setup_logging) -> int:
    import signal
    import threading

    from laminar_common.launch.local_etcd import LocalEtcd

    setup_logging("INFO")
    mutual = False
    if args.auth_dir:
        from laminar_common.auth import etcd_tls_paths

        mutual = "client_cert" in etcd_tls_paths(args.auth_dir)
    etcd = LocalEtcd(data_dir=args.data_dir, port=args.port, tls_dir=args.auth_dir,
                     client_cert_auth=mutual).start()
    print(f"etcd listening on {etcd.endpoint} (data dir {etcd.data_dir}); Ctrl-C stops it",
          flush=True)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(0.5):
        if etcd.proc is None or etcd.proc.poll() is not None:
            print("etcd exited", file=sys.stderr)
            return 1
    etcd.close()
    return 0


def _cmd_member(args, setup_logging) -> int:
    from laminar_common.config import dump_config, load_config
    from laminar_common.launch.member import MemberConfig, MemberService

    config = load_config(MemberConfig, args.config, args.set)
    setup_logging(config.logging.level, config.job, config.member_id, config.logging.json_format)
    import logging

    logging.getLogger("laminar_common.launch.cli").info("resolved config:\n%s", dump_config(config))
    return MemberService(config).run_forever()


def _cmd_report(args) -> int:
    from laminar_common.launch.report import find_worker_stats, load_metrics, summarize, write_plots

    rows, summary = load_metrics(args.run_dir)
    print(summarize(rows, summary))
    plots = write_plots(rows, summary, args.run_dir, workers=find_worker_stats(args.run_dir))
    print(f"metrics: {args.run_dir}/metrics.jsonl")
    print("plots: " + (", ".join(map(str, plots)) if plots else
                       "none (pip install 'laminar-common[report]' for matplotlib)"))
    return 0


def _cmd_prompts(args) -> int:
    from pathlib import Path

    from laminar_common.launch.tasks import make_task_records, parse_difficulty, write_jsonl

    try:
        records = make_task_records(args.task, args.n, args.seed, split=args.split,
                                    **parse_difficulty(args.task, args.difficulty))
    except ValueError as exc:
        print(f"laminar prompts: {exc}", file=sys.stderr)
        return 2
    if Path(args.out).is_file():
        print(f"{args.out} exists; leaving it")
        return 0
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    n = write_jsonl(args.out, records)
    print(f"wrote {n} {args.task} records ({args.split}) to {args.out}")
    return 0


def _cmd_status(args) -> int:
    import json

    from laminar_common.auth import etcd_tls_for
    from laminar_common.etcd import EtcdCoordinator

    tls = {"ca_cert": args.etcd_ca, "client_cert": args.etcd_cert, "client_key": args.etcd_key}
    tls.update(etcd_tls_for(args.auth_dir, tls))  # the tiers' rule
    coord = EtcdCoordinator([args.etcd], args.job, connect_timeout_s=5, **tls)
    try:
        latest = coord.latest_version()
        print(f"job {args.job}: latest weight version "
              f"{latest.version if latest else 'none'}")
        print("members:")
        for member_id, rec in sorted(coord.members().items(), key=lambda x: (x[1].role, x[0])):
            print(f"  {rec.role:<8} {member_id:<20} {rec.address:<28} host={rec.host} "
                  f"pkg={rec.package_version} proto={rec.protocol_version}")
        trainer = coord.get_state("trainer")
        if trainer:
            t = json.loads(trainer)
            print(f"trainer: step {t['step']}/{t['total_steps']} v{t['version']} "
                  f"reward {t['reward_mean']:.3f} tokens/s {t['tokens_per_s']:.1f} "
                  f"staleness mean {t['staleness_mean']:.2f} max {t['staleness_max']} "
                  f"buffer {t['buffer']}")
        manager = coord.get_state("manager")
        if manager:
            m = json.loads(manager)
            print(f"manager: ledger {m['ledger']}, repacks {m['repacks']}, "
                  f"workers lost {m['workers_lost']}")
            for wid, w in sorted(m["workers"].items()):
                print(f"  {wid:<20} v{w['version']:<4} active {w['active']}/{w['capacity']} "
                      f"assigned {w['assigned']} kv {w['kv_used']}")
    finally:
        coord.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
