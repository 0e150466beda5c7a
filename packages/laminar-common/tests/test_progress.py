import io

from laminar_common.progress import ProgressLines


def test_progress_lines_at_the_first_step_every_interval_and_the_last():
    now = [0.0]
    out = io.StringIO()
    p = ProgressLines("warm start", 150, every_s=10, stream=out, clock=lambda: now[0])
    printed = []
    for step in range(1, 151):
        now[0] = step * 0.5  # 75 s in all
        printed.append(p.update(step, loss=1.0 / step))
    lines = out.getvalue().splitlines()
    assert printed[0] and printed[-1] and sum(printed) == len(lines) == 9
    assert lines[0] == "warm start: step 1/150 (1%) loss 1.000 | 0:00 elapsed, ETA 1:14"
    assert lines[-1].startswith("warm start: step 150/150 (100%) loss 0.007 | 1:15 elapsed, "
                                "ETA 0:00")
