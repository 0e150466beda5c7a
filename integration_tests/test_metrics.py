"""Issue 8: each tier serves Prometheus metrics during a run (scraped over loopback),
and fuzzed frames sent to a running stack are refused, counted, and harmless."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import metric_value, scrape_metrics, wait_until
from laminar_common import codec
from laminar_common.etcd import EtcdCoordinator
from laminar_common.launch.processes import ChildProcess
from laminar_common.transport import ZmqPushSender

REPO = Path(__file__).resolve().parents[1]






def test_every_tier_serves_metrics_during_a_run(tmp_path):
    job = yaml.safe_load((REPO / "examples" / "simulated.yaml").read_text())
    job["job"] = "metrics"
    job["run_dir"] = str(tmp_path / "run")
    job["tiers"]["trainer"]["config"]["total_steps"] = 200
    for spec in job["tiers"].values():
        spec["config"]["metrics"] = {"port": 0}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    up = ChildProcess("up", [sys.executable, "-m", "laminar_common.launch.cli", "up", str(path)],
                      str(tmp_path / "up.log"), cwd=str(tmp_path))
    try:
        up.wait_for_line(r"trainer: STEP 3 ", 120)
        endpoint = yaml.safe_load((tmp_path / "run" / "configs" / "trainer.yaml").read_text())
        coord = EtcdCoordinator(endpoint["etcd"]["endpoints"], "metrics")
        members = coord.members()
        urls = {m.member_id: m.extra["metrics"] for m in members.values()}
        assert set(urls) == {"relay-0", "manager", "worker-0", "worker-1", "trainer"}
        # `laminar status` lists the same URLs (metrics.host is loopback: as advertised).
        status = subprocess.run([sys.executable, "-m", "laminar_common.launch.cli", "status",
                                 "--etcd", endpoint["etcd"]["endpoints"][0], "--job", "metrics"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        listed = {line.split()[1]: line.split()[-1] for line in status.stdout.splitlines()
                  if line.startswith("  ") and " metrics=" in line}
        assert listed == {member: f"metrics={url}" for member, url in urls.items()}, status.stdout
        scraped = {}

        def all_moving():
            for member, url in urls.items():
                scraped[member] = scrape_metrics(url)
            return (metric_value(scraped["trainer"], "laminar_trainer_steps_total") >= 3
                    and metric_value(scraped["worker-0"], "laminar_worker_trajectories_total") > 0
                    and metric_value(scraped["manager"], "laminar_manager_dispatched_total") > 0
                    and metric_value(scraped["relay-0"], "laminar_relay_versions_stored") >= 1)

        assert wait_until(all_moving, 30), {k: len(v) for k, v in scraped.items()}
        t = scraped["trainer"]
        assert metric_value(t, "laminar_trainer_tokens_consumed_total") > 0
        assert metric_value(t, "laminar_trainer_staleness_trajectories") > 0
        # The per-step training figures (the metrics.jsonl row) are gauges too; this job's
        # step is simulated, so the loss figures are 0 but exported, and the
        # trajectories' own figures are real.
        assert any(k.startswith("laminar_trainer_grad_norm{") for k in t), sorted(t)
        assert any(k.startswith("laminar_trainer_clip_fraction_high{") for k in t)
        assert metric_value(t, "laminar_trainer_response_length_mean") > 0
        assert metric_value(t, "laminar_trainer_reward_by_source") >= 0
        assert any('laminar_trainer_reward_by_source{' in line and 'data_source="none"' in line
                   for line in t), [line for line in t if "reward_by_source" in line]
        assert 'job="metrics"' in next(iter(t))
        assert metric_value(scraped["manager"], "laminar_manager_workers") == 2
        assert metric_value(scraped["worker-1"], "laminar_worker_weight_version") >= 0
        assert metric_value(scraped["relay-0"], "laminar_relay_is_master") == 1

        # Hostile input: fuzzed frames at the trainer's trajectory socket and the
        # manager's ack socket are refused and counted; training goes on.
        rng = random.Random(7)
        good = codec.encode(codec.Ack(trajectory_ids=("x",), trainer_step=0, trainer_version=0))
        for target in (members["trainer"].address, members["manager"].extra["ack"]):
            sender = ZmqPushSender(target)
            for _ in range(100):
                frame = bytearray(good)
                frame[rng.randrange(len(frame))] = rng.randrange(256)
                sender.send_frame(bytes(frame[: rng.randrange(1, len(frame) + 1)]))
            sender.send_frame(b"\x00" * 10)
            sender.close()
        steps_before = metric_value(scrape_metrics(urls["trainer"]), "laminar_trainer_steps_total")

        def refused_and_training():
            t = scrape_metrics(urls["trainer"])
            return (metric_value(t, "laminar_trainer_rejected_frames_total") > 0
                    and metric_value(t, "laminar_trainer_steps_total") >= steps_before + 3)

        assert wait_until(refused_and_training, 30)
        assert all(m in coord.members() for m in urls), "a tier died from fuzzed frames"
        coord.close()
    finally:
        up.stop(grace_s=30)
