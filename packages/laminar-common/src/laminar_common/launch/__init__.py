"""laminar_common.launch: the operator toolkit.

Owns what runs a job rather than what a job is made of: the ``laminar`` CLI
(:mod:`.cli`), the job
file (:mod:`.jobfile`), the local and Ray launchers (:mod:`.local`,
:mod:`.ray_backend`), checking every tier's config before a launch
(:mod:`.preflight`), a launch's run dir (:mod:`.rundir`), a local etcd (:mod:`.local_etcd`),
child processes and their readiness (:mod:`.processes`), run reports
(:mod:`.report`) and a bare member for membership demos (:mod:`.member`, :mod:`.demo`).
No tier imports it; the core never imports it. The example jobs' tasks, models and
warm starts are the laminar-examples package's (``laminar-examples prompts``,
``warmstart``), not this toolkit's.

Names below are imported on first use.
"""

from laminar_common._lazy import lazy_exports

_EXPORTS = {
    "JobFile": "jobfile", "TierSpec": "jobfile", "load_job": "jobfile",
    "LocalLauncher": "local", "run_job": "up",
    "LocalEtcd": "local_etcd", "find_etcd_binary": "local_etcd", "free_port": "local_etcd",
    "ChildProcess": "processes",
    "RunDir": "rundir",
}

__all__ = list(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
