"""Benchmark the relay tier: chain broadcast time and publisher stall vs chain length.

Publishes S bytes through chains of N relays (default N = 1, 2, 4), each relay
a separate ``laminar-relay serve`` process on loopback with a real local etcd,
and reports, per N, in one run:

- broadcast: from the start of ``RelayClient.publish`` until the last relay
  sealed the version (stored and verified; the time each relay reports in
  ``Health.sealed_at``);
- GB/s: S / broadcast;
- x ideal: broadcast / one raw single-stream loopback socket copy of the same
  S bytes between two processes (measured in the same run);
- x N=1: broadcast / broadcast of the N=1 chain;
- stall: how long ``publish`` blocked the publisher (the hand-off to the master).

``--dataplanes`` also measures the two candidate bulk transports on their own
(ZeroMQ multipart vs gRPC client streaming, plus the raw socket), which is
how the relay's data plane was chosen.

All processes share this machine's CPUs: on a small machine the relays compete
with each other and with the publisher for cores (each relay copies and
checksums every byte), so longer chains look worse than they would on one host
per relay. The output says how many CPUs there were.

Usage: python tools/bench_relay.py [--size-mb 256] [--relays 1,2,4] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from laminar_common.errors import LaminarError
from laminar_common.relay.wire import GRPC_OPTIONS

MiB = 1024 * 1024
LEASE_LAPSES: dict[str, int] = {}
"""Relays a health call by name failed for (their etcd record gone for a moment)."""


# -- raw transports (used for the ideal and for --dataplanes) ---------------


def _receiver_main(kind: str, port: int, size: int, chunk: int) -> None:
    """Child process: receive ``size`` bytes of ``kind`` into one buffer, then ack."""
    buf = bytearray(size)
    view = memoryview(buf)
    if kind == "raw":
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(1)
        print("READY", flush=True)
        conn, _ = listener.accept()
        n = 0
        while n < size:
            n += conn.recv_into(view[n:], min(size - n, 4 * MiB))
        conn.sendall(b"k")
        conn.recv(1)
        return
    if kind == "zmq":
        import zmq

        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.RCVHWM, 8)
        sock.bind(f"tcp://127.0.0.1:{port}")
        print("READY", flush=True)
        got = 0
        ident = b""
        while got < size:
            ident, header, payload = sock.recv_multipart(copy=False)
            offset = int.from_bytes(header.bytes, "big")
            view[offset : offset + len(payload.buffer)] = payload.buffer
            got += len(payload.buffer)
        sock.send_multipart([ident.bytes if hasattr(ident, "bytes") else ident, b"k"])
        sock.recv_multipart()
        return
    if kind == "grpc":
        from concurrent import futures

        import grpc

        done = []

        def push(requests, context):
            got = 0
            for msg in requests:
                offset = int.from_bytes(msg[:8], "big")
                view[offset : offset + len(msg) - 8] = memoryview(msg)[8:]
                got += len(msg) - 8
            done.append(got)
            return b"k"

        handler = grpc.method_handlers_generic_handler(
            "bench.Bulk", {"Push": grpc.stream_unary_rpc_method_handler(push)}
        )
        server = grpc.server(
            futures.ThreadPoolExecutor(2), options=GRPC_OPTIONS
        )
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("READY", flush=True)
        server.wait_for_termination(600)
        return
    raise SystemExit(f"unknown receiver kind {kind!r}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_transport(kind: str, data: bytes, chunk: int) -> float:
    """Seconds to move ``data`` to a receiver process with transport ``kind``."""
    port = _free_port()
    child = subprocess.Popen(
        [sys.executable, __file__, "--_receiver", kind, str(port), str(len(data)), str(chunk)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != "READY":
            raise RuntimeError(f"{kind} receiver did not start")
        view = memoryview(data)
        if kind == "raw":
            with socket.create_connection(("127.0.0.1", port)) as s:
                t0 = time.perf_counter()
                s.sendall(view)
                s.recv(1)
                dt = time.perf_counter() - t0
                s.sendall(b"x")
            return dt
        if kind == "zmq":
            import zmq

            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.SNDHWM, 8)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port}")
            t0 = time.perf_counter()
            for off in range(0, len(data), chunk):
                sock.send_multipart([off.to_bytes(8, "big"), view[off : off + chunk]], copy=False)
            sock.recv()
            dt = time.perf_counter() - t0
            sock.send(b"x")
            sock.close()
            return dt
        if kind == "grpc":
            import grpc

            channel = grpc.insecure_channel(
                f"127.0.0.1:{port}", options=GRPC_OPTIONS
            )
            push = channel.stream_unary("/bench.Bulk/Push")

            def requests():
                for off in range(0, len(data), chunk):
                    yield off.to_bytes(8, "big") + view[off : off + chunk]

            t0 = time.perf_counter()
            push(requests(), timeout=600)
            dt = time.perf_counter() - t0
            channel.close()
            return dt
        raise ValueError(kind)
    finally:
        child.kill()
        child.wait()


# -- the relay chain ----------------------------------------------------------


class Chain:
    """N relay processes of one job."""

    def __init__(
        self,
        etcd_endpoint: str,
        job: str,
        n: int,
        size: int,
        verify_forwarded: bool,
        log_dir: str,
        link_bytes_per_s: int = 0,
        hosts: dict | None = None,
    ) -> None:
        self.job = job
        self.procs: list[subprocess.Popen] = []
        self.names = [f"{job}-r{i}" for i in range(n)]
        for i, name in enumerate(self.names):
            # On emulated hosts (--hosts): relay i on host relay-i, bound to its address.
            where = hosts[f"relay-{i}"] if hosts else None
            bind = where["address"] if where else "127.0.0.1"
            args = [
                "serve",
                "--set",
                f"job={job}",
                "--set",
                f"member_id={name}",
                "--set",
                f"bind_host={bind}",
                "--set",
                f"advertise_host={bind}",
                *(["--set", f"host_id=relay-{i}"] if where else []),
                "--set",
                f"etcd.endpoints=[{etcd_endpoint}]",
                "--set",
                "etcd.ttl_s=5",
                "--set",
                f"store.max_bytes={3 * size + 64 * MiB}",
                "--set",
                f"store.max_version_bytes={size + 16 * MiB}",
                "--set",
                "store.keep_versions=1",
                "--set",
                "chain.control_interval_s=0.5",
                "--set",
                f"chain.verify_forwarded={'true' if verify_forwarded else 'false'}",
                "--set",
                f"chain.max_forward_bytes_per_s={link_bytes_per_s}",
                "--set",
                "logging.level=WARNING",
            ]
            log = open(os.path.join(log_dir, f"{name}.log"), "w")
            wrap = ["ip", "netns", "exec", where["netns"]] if where else []
            self.procs.append(
                subprocess.Popen(
                    [*wrap, sys.executable, "-m", "laminar_relay.cli", *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
            log.close()

    def wait_ready(self, client, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(p.poll() is None for p in self.procs):
                try:
                    chains = {tuple(client.health(n).chain) for n in client.relays()}
                    if (
                        len(client.relays()) == len(self.names)
                        and len(chains) == 1
                        and len(chains.pop()) == len(self.names)
                    ):
                        return
                except Exception:  # noqa: BLE001 - a relay may not answer yet; retry until the deadline
                    pass
            else:
                raise RuntimeError(f"a relay of {self.job} exited; see its log")
            time.sleep(0.1)
        raise RuntimeError(f"chain of {len(self.names)} relays not ready in {timeout_s}s")

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def broadcast_once(client, names: list[str], version: int, tensors, poll_s: float = 0.05):
    """Publish one version; return (stall_s, broadcast_s, stages).

    Broadcast ends at the latest time any relay sealed the version, as the
    relays themselves recorded it (``Health.sealed_at``), so slow polling here
    does not add to it or steal CPU from the relays. ``stages`` has, per relay
    in chain order, when its session opened, its first chunk was stored and
    it sealed the version (seconds after the publish started).
    """
    start = time.time()
    t0 = time.perf_counter()
    result = client.publish(version, tensors)
    stall = time.perf_counter() - t0
    assert result.version == version
    deadline = time.monotonic() + 300
    sealed: dict[str, object] = {}
    while len(sealed) < len(names):
        if time.monotonic() > deadline:
            raise RuntimeError(f"version {version} did not reach every relay")
        for name in names:
            if name not in sealed:
                try:
                    health = client.health(name)
                except LaminarError as exc:
                    # Its record may be gone for a moment (a lease lost under load and
                    # registered again): counted, asked again until the deadline.
                    LEASE_LAPSES[name] = LEASE_LAPSES.get(name, 0) + 1
                    if LEASE_LAPSES[name] == 1:
                        print(f"      (relay {name} did not answer by name: {exc})", flush=True)
                    continue
                if version in health.sealed_at:
                    sealed[name] = health
        time.sleep(poll_s)
    order = list(next(iter(sealed.values())).chain) or names
    stages = [(name, sealed[name].begun_at[version] - start,
               sealed[name].first_chunk_at[version] - start,
               sealed[name].sealed_at[version] - start) for name in order]
    return stall, max(h.sealed_at[version] for h in sealed.values()) - start, stages


# -- delta versions over real optimizer updates -------------------------------------

MODELS = {
    # name: (transformers config class, kwargs); random init, real shapes.
    "demo": ("LlamaConfig", dict(vocab_size=64, hidden_size=128, intermediate_size=384,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=4, max_position_embeddings=64,
                                 tie_word_embeddings=False)),
    "qwen2.5-0.5b": ("Qwen2Config", dict(vocab_size=151936, hidden_size=896,
                                         intermediate_size=4864, num_hidden_layers=24,
                                         num_attention_heads=14, num_key_value_heads=2,
                                         max_position_embeddings=32768,
                                         tie_word_embeddings=True)),
}


def delta_sequence(model_name: str, lr: float, steps: int, seq_len: int = 64,
                   batch: int = 4) -> None:
    """Real AdamW steps on ``model_name`` (random init, a language-modelling loss on
    random tokens); after each step the bf16 weights as the trainer publishes them,
    and the delta against the previous version, as the relay client builds it."""
    import torch
    import transformers

    from laminar_common.relay.delta import apply_delta, encode_delta
    from laminar_common.relay.manifests import as_named_buffers, build_manifest, flatten

    torch.manual_seed(0)
    cls_name, kwargs = MODELS[model_name]
    config = getattr(transformers, cls_name)(**kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"\ndelta versions: {model_name} ({n_params / 1e6:.1f}M parameters, random init), "
          f"AdamW lr={lr:g}, {steps} steps of a language-modelling loss on random tokens "
          f"(batch {batch} x {seq_len}); published as bfloat16")
    print(f"{'version':>7} {'full_MiB':>9} {'delta_MiB':>10} {'fraction':>9} {'changed':>8} "
          f"{'encode_s':>8} {'apply_s':>8}")

    def publish_form(version):
        tensors = [(n, "bfloat16", tuple(t.shape),
                    t.detach().to(torch.bfloat16).contiguous().view(torch.uint8).numpy())
                   for n, t in model.state_dict().items()]
        m, buffers = build_manifest(version, tensors)
        return m, flatten(m, buffers)

    prev_m, prev = publish_form(0)
    for version in range(1, steps + 1):
        ids = torch.randint(0, config.vocab_size, (batch, seq_len))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        full, flat = publish_form(version)
        t0 = time.perf_counter()
        parts = as_named_buffers(encode_delta(version - 1, full, prev, flat))
        delta, dbuf = build_manifest(version, parts)
        t1 = time.perf_counter()
        import msgspec

        delta = msgspec.structs.replace(delta, base_version=version - 1, full=full)
        dflat = flatten(delta, dbuf)
        t2 = time.perf_counter()
        rebuilt = apply_delta(delta, dflat, prev)
        t3 = time.perf_counter()
        assert rebuilt == flat, "delta did not rebuild the version bit for bit"
        changed = sum(t.shape[0] for t in delta.tensors if t.name.endswith("#delta.val"))
        print(f"{version:>7} {full.total_bytes / MiB:>9.1f} {delta.total_bytes / MiB:>10.2f} "
              f"{delta.total_bytes / full.total_bytes:>9.2%} {changed / n_params:>8.2%} "
              f"{t1 - t0:>8.3f} {t3 - t2:>8.3f}")
        prev_m, prev = full, flat
    del prev_m
    print("every rebuilt version equals the published bytes (bit-exact); a chain of N relays "
          "moves N x the delta's bytes for a delta version instead of N x the full version's")


# -- --hosts: the chain on emulated hosts with capped links ---------------------------


def _tensors(data: bytes, n_tensors: int = 8):
    """``data`` as ``n_tensors`` uint8 tensors (name, dtype, shape, buffer), zero-copy."""
    size = len(data)
    per = size // n_tensors
    return [
        (
            f"layer{i}.weight",
            "uint8",
            (per if i < n_tensors - 1 else size - per * (n_tensors - 1),),
            memoryview(data)[i * per : (i + 1) * per if i < n_tensors - 1 else size],
        )
        for i in range(n_tensors)
    ]


def _reader_main(etcd_endpoint: str, job: str, host_id: str, last_version: int) -> None:
    """A reader on a relay's host: fetch every version as soon as etcd shows it (from the
    relay on this host, which may still be receiving it through the chain), print
    ``{"version", "done"}`` per version, exit after ``last_version``."""
    from laminar_common.etcd import EtcdCoordinator
    from laminar_common.relay.client import RelayClient

    coord = EtcdCoordinator([etcd_endpoint], job, ttl_s=5)
    client = RelayClient(coord, host=host_id, client_id=f"reader-{host_id}", rpc_timeout_s=60)
    print(json.dumps({"ready": True}), flush=True)
    done = 0
    try:
        while done < last_version:
            rec = coord.latest_version()
            if rec is None or rec.version <= done:
                time.sleep(0.005)
                continue
            with client.fetch(rec.version, wait_s=120) as got:
                source = got.source
            done = rec.version
            print(json.dumps({"version": done, "done": time.time(), "source": source}),
                  flush=True)
    finally:
        client.close()
        coord.close()


def hosts_main(args: argparse.Namespace) -> int:
    """Build the hosts (trainer + one per relay), etcd on the trainer's, then run the
    measurement inside the trainer's host (``--_hosts-inner``)."""
    from laminar_common.testing.hosts import EmulatedHosts, start_etcd, unavailable

    why = unavailable()
    if why:
        print(f"--hosts: {why}", file=sys.stderr)
        return 2
    n_max = max(int(x) for x in args.relays.split(","))
    names = ["trainer", *[f"relay-{i}" for i in range(n_max)]]
    tmp = tempfile.mkdtemp(prefix="bench-relay-hosts-")
    with EmulatedHosts(names, rate_mbit=args.link_mbit) as hosts:
        etcd, _ = start_etcd(hosts, "trainer", os.path.join(tmp, "etcd"))
        try:
            spec = {"etcd": etcd.endpoint, "log_dir": tmp,
                    "hosts": {n: {"address": hosts.address(n), "netns": hosts[n].netns}
                              for n in names}}
            inner = [sys.executable, os.path.abspath(__file__), "--_hosts-inner",
                     json.dumps(spec), *sys.argv[1:]]
            rc = subprocess.call(hosts.cmd("trainer", inner))
        finally:
            etcd.close()
    if rc == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    return rc


def _start_readers(spec: dict, job: str, n: int, per_host: int, last_version: int):
    """``per_host`` reader processes on each of the first ``n`` relays' hosts, and a
    thread each collecting what they print."""
    readers = []
    for i in range(n):
        for r in range(per_host):
            proc = subprocess.Popen(
                ["ip", "netns", "exec", spec["hosts"][f"relay-{i}"]["netns"], sys.executable,
                 os.path.abspath(__file__), "--_reader", spec["etcd"], job, f"relay-{i}",
                 str(last_version)],
                stdout=subprocess.PIPE, stderr=open(os.path.join(
                    spec["log_dir"], f"{job}-reader-{i}-{r}.log"), "w"), text=True)
            lines: list[dict] = []
            t = threading.Thread(target=lambda p=proc, out=lines: out.extend(
                json.loads(x) for x in p.stdout), daemon=True)
            t.start()
            readers.append((proc, lines, t))
    return readers


def hosts_inner(spec: dict, args: argparse.Namespace) -> int:
    """On the trainer's host: per chain length, N relays on hosts relay-0..N-1 and readers
    on each, publish versions through links at B, and compare with S/B."""
    from laminar_common.etcd import EtcdCoordinator
    from laminar_common.relay.client import RelayClient

    size, chunk = args.size_mb * MiB, args.chunk_mb * MiB
    rate = args.link_mbit * 1e6 / 8  # bytes/s each way on every link
    limit = size / rate
    ns = [int(x) for x in args.relays.split(",")]
    print(f"relay broadcast on emulated hosts: {args.size_mb} MiB per version, {args.chunk_mb} "
          f"MiB chunks, chains {ns}, {args.repeat} publish(es) each; the trainer and every "
          f"relay on a host of its own (network namespaces on one machine), every link capped "
          f"at {args.link_mbit:g} Mbit/s each way (tc tbf); {args.readers} reader(s) per relay "
          f"host fetching each version; real etcd and relays, verify_forwarded on")
    print(f"machine: {os.cpu_count()} CPUs shared by every host; S/B = {limit:.3f} s (the "
          f"physical limit; TCP/IP headers alone cost ~4% of a link)")
    tensors = _tensors(os.urandom(size))
    print(f"{'N':>3} {'broadcast_s':>11} {'x S/B':>6} {'chain_best_s':>12} {'x best':>6} "
          f"{'stall_s':>7} {'readers_s':>9} {'x S/B':>6} {'relay_cpu_s':>{5 * max(ns) + 4}}")
    failed = False
    for n in ns:
        job = f"hosts-{n}"
        chain = Chain(spec["etcd"], job, n, size, True, spec["log_dir"], 0, hosts=spec["hosts"])
        coord = EtcdCoordinator([spec["etcd"]], job, ttl_s=5)
        client = RelayClient(coord, chunk_bytes=chunk, publish_timeout_s=300, rpc_timeout_s=30)
        last = args.repeat + 1
        readers = []
        try:
            chain.wait_ready(client)
            readers = _start_readers(spec, job, n, args.readers, last)
            results, starts, cpus = [], {}, []
            for v in range(1, last + 1):
                time.sleep(args.gap_s if v > 1 else 0.5)
                before = [cpu_seconds(p.pid) for p in chain.procs]
                starts[v] = time.time()
                results.append(broadcast_once(client, chain.names, v, tensors))
                cpus.append([cpu_seconds(p.pid) - b for p, b in zip(chain.procs, before)])
            for proc, _, t in readers:
                proc.wait(120)
                t.join(10)
        except Exception as exc:  # noqa: BLE001 - report and go on with the next N
            print(f"{n:>3} FAILED: {exc} (logs in {spec['log_dir']})")
            failed = True
            continue
        finally:
            for proc, _, _ in readers:
                if proc.poll() is None:
                    proc.kill()
            client.close()
            coord.close()
            chain.stop()
        measured = results[1:]  # version 1 warms the chain up (first connections, buffers)
        stall = statistics.median(r[0] for r in measured)
        bcast = statistics.median(r[1] for r in measured)
        cpu = [statistics.median(c[i] for c in cpus[1:]) for i in range(n)]
        best = limit + (n - 1) * chunk / rate
        per_version = [max((x["done"] for _, lines, _ in readers for x in lines
                            if x.get("version") == v), default=float("nan")) - starts[v]
                       for v in range(2, last + 1)]
        got = statistics.median(per_version) if readers else float("nan")
        print(f"{n:>3} {bcast:>11.3f} {bcast / limit:>6.2f} {best:>12.3f} {bcast / best:>6.2f} "
              f"{stall:>7.3f} {got:>9.3f} {got / limit:>6.2f} "
              f"{' '.join(f'{c:.2f}' for c in cpu):>{5 * max(ns) + 4}}")
        stages = measured[-1][2]
        print("      hops (s after publish start: opened / first chunk stored / sealed): "
              + " | ".join(f"{i}: {b:.3f} / {f:.3f} / {e:.3f}"
                           for i, (_, b, f, e) in enumerate(stages)))
        sources = sorted({x.get("source") for _, lines, _ in readers for x in lines
                          if "version" in x})
        print(f"      readers read through: {', '.join(map(str, sources)) or '-'}"
              + (f"; relays whose record lapsed under load: {sorted(LEASE_LAPSES)}"
                 if LEASE_LAPSES else ""))
        LEASE_LAPSES.clear()
    print("broadcast: publish start -> the last relay sealed the version; readers: -> the "
          "last reader on any relay host held it; x S/B: against the link's limit; chain_best:"
          " S/B + (N-1) x chunk/B, the best a pipelined chain of N can do")
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--size-mb", type=int, default=256, help="bytes per version, MiB (default 256)")
    p.add_argument("--chunk-mb", type=int, default=4, help="chunk size, MiB (default 4)")
    p.add_argument("--relays", default="1,2,4", help="chain lengths to measure (default 1,2,4)")
    p.add_argument("--repeat", type=int, default=2, help="publishes per chain length (median)")
    p.add_argument(
        "--verify-forwarded",
        choices=("on", "off", "both"),
        default="on",
        help="checksum chunks on every relay (on), only on the master (off), or both",
    )
    p.add_argument(
        "--link-mb-s",
        type=float,
        default=0.0,
        help="pace every relay-to-relay link to this many MB/s (simulates a network "
        "slower than the CPUs, to show the pipelining; 0: no pacing)",
    )
    p.add_argument(
        "--gap-s",
        type=float,
        default=1.0,
        help="idle time before each measured publish, as between training steps "
        "(relays prepare the next version's buffer meanwhile; default 1.0)",
    )
    p.add_argument(
        "--deltas",
        default="",
        help="also measure delta versions over real optimizer updates: MODEL:LR:STEPS,... "
        f"with MODEL one of {', '.join(MODELS)} (e.g. demo:2e-4:5,qwen2.5-0.5b:1e-6:3)",
    )
    p.add_argument(
        "--dataplanes",
        action="store_true",
        help="also measure ZeroMQ multipart vs gRPC streaming on their own",
    )
    p.add_argument(
        "--hosts",
        action="store_true",
        help="the trainer and each relay on an emulated host of its own (network "
        "namespaces, needs root), every link capped at --link-mbit; readers on every relay's "
        "host fetch each version; prints the broadcast against S/B",
    )
    p.add_argument(
        "--link-mbit",
        type=float,
        default=1000.0,
        help="with --hosts: every host's link rate each way, Mbit/s (default 1000)",
    )
    p.add_argument(
        "--readers",
        type=int,
        default=1,
        help="with --hosts: reader processes fetching each version on every relay's host "
        "(default 1; 0: none)",
    )
    return p


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--_receiver":
        kind, port, size, chunk = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        _receiver_main(kind, port, size, chunk)
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--_reader":
        _reader_main(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--_hosts-inner":
        return hosts_inner(json.loads(sys.argv[2]), _parser().parse_args(sys.argv[3:]))
    p = _parser()
    args = p.parse_args()
    if args.hosts:
        return hosts_main(args)

    from laminar_common.etcd import EtcdCoordinator
    from laminar_common.launch.local_etcd import LocalEtcd
    from laminar_common.relay.client import RelayClient

    size, chunk = args.size_mb * MiB, args.chunk_mb * MiB
    link = int(args.link_mb_s * 1e6)
    ns = [int(x) for x in args.relays.split(",")]
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.verify_forwarded]
    print(
        f"relay broadcast benchmark: {args.size_mb} MiB per version, {args.chunk_mb} MiB chunks, "
        f"chains {ns}, {args.repeat} publish(es) each; loopback, real etcd, one process per relay"
    )
    print(f"machine: {os.cpu_count()} CPUs shared by the publisher and all relays")
    data = os.urandom(size)
    tensors = _tensors(data)

    ideal = min(measure_transport("raw", data, chunk) for _ in range(2))
    print(
        f"ideal (raw single-stream loopback socket copy, best of 2): {ideal:.3f} s "
        f"= {size / ideal / 1e9:.2f} GB/s"
    )
    zmq_times = [measure_transport("zmq", data, chunk) for _ in range(3)]
    zmq_plane = min(zmq_times)
    print(
        f"data plane zmq : best {zmq_plane:.3f} s = {size / zmq_plane / 1e9:.2f} GB/s "
        f"(x{zmq_plane / ideal:.2f} ideal; runs: {', '.join(f'{t:.3f}' for t in zmq_times)}); "
        "the relay's data plane on its own: x zmq below is the relay's cost over it"
    )
    if args.dataplanes:
        for kind in ("grpc",):
            times = [measure_transport(kind, data, chunk) for _ in range(3)]
            best = min(times)
            print(
                f"data plane {kind:4s}: best {best:.3f} s = {size / best / 1e9:.2f} GB/s "
                f"(x{best / ideal:.2f} ideal; runs: {', '.join(f'{t:.3f}' for t in times)})"
            )

    log_dir = tempfile.mkdtemp(prefix="bench-relay-")
    failed = False
    with LocalEtcd() as etcd:
        for verify in modes:
            if link:
                print(
                    f"\nsimulated links: every relay-to-relay link paced at {args.link_mb_s} MB/s; "
                    "a pipelined chain needs about size/link + (N-2) x chunk/link for N >= 2 "
                    "(model_s), an unpipelined one (N-1) x size/link"
                )
            print(
                f"\nverify_forwarded={'on' if verify else 'off'} "
                f"({'every relay' if verify else 'only the master'} checksums every chunk)"
            )
            print(
                f"{'N':>3} {'broadcast_s':>12} {'GB/s':>6} {'x ideal':>8} {'x zmq':>6} "
                f"{'x N=1':>6} {'stall_s':>8} {'wire_MiB':>8} {'pub_cpu':>6} "
                f"{'relay_cpu_s':>{5 * max(ns) + 4}} {'cpu/ncpu':>7}"
                + (f" {'model_s':>8}" if link else "")
            )
            base = None
            for n in ns:
                job = f"bench-{n}-{'v' if verify else 'nv'}"
                chain = Chain(etcd.endpoint, job, n, size, verify, log_dir, link)
                coord = EtcdCoordinator([etcd.endpoint], job, ttl_s=5)
                client = RelayClient(
                    coord, chunk_bytes=chunk, publish_timeout_s=300, rpc_timeout_s=30
                )
                try:
                    chain.wait_ready(client)
                    # Version 1 warms the chain up (first connections, first buffers) and
                    # is not counted; between the measured versions the chain idles for
                    # --gap-s, as it does between training steps.
                    broadcast_once(client, chain.names, 1, tensors)
                    results, cpus = [], []
                    pids = [os.getpid()] + [p.pid for p in chain.procs]
                    for v in range(2, args.repeat + 2):
                        time.sleep(args.gap_s)
                        before = [cpu_seconds(pid) for pid in pids]
                        results.append(broadcast_once(client, chain.names, v, tensors))
                        cpus.append([cpu_seconds(pid) - b for pid, b in zip(pids, before)])
                except Exception as exc:  # noqa: BLE001 - report and go on with the next N
                    print(f"{n:>3} FAILED: {exc} (logs in {log_dir})")
                    failed = True
                    continue
                finally:
                    client.close()
                    coord.close()
                    chain.stop()
                stall = statistics.median(r[0] for r in results)
                bcast = statistics.median(r[1] for r in results)
                cpu = [statistics.median(c[i] for c in cpus) for i in range(len(pids))]
                base = base or bcast
                model = ""
                if link and n >= 2:
                    model = f" {(size + (n - 2) * chunk) / link:>8.3f}"
                print(
                    f"{n:>3} {bcast:>12.3f} {size / bcast / 1e9:>6.2f} {bcast / ideal:>8.2f} "
                    f"{bcast / zmq_plane:>6.2f} {bcast / base:>6.2f} {stall:>8.3f} "
                    f"{n * size / MiB:>8.0f} {cpu[0]:>6.2f} "
                    f"{' '.join(f'{c:.2f}' for c in cpu[1:]):>{5 * n + 4}} "
                    f"{sum(cpu) / (os.cpu_count() or 1):>7.3f}{model}"
                )
                stages = results[-1][2]
                print("      hops (s after publish start: opened / first chunk stored / sealed): "
                      + " | ".join(f"{i}: {b:.3f} / {f:.3f} / {e:.3f}"
                                   for i, (_, b, f, e) in enumerate(stages)))
    for spec in filter(None, args.deltas.split(",")):
        model_name, lr, steps = spec.split(":")
        delta_sequence(model_name, float(lr), int(steps))
    if not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
