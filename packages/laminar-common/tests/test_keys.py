import pytest

from laminar_common.keys import JobKeys


def test_key_schema():
    k = JobKeys("job1")
    assert k.member("worker", "w-1") == "/laminar/job1/members/worker/w-1"
    assert k.parse_member("/laminar/job1/members/worker/w-1") == ("worker", "w-1")
    assert k.weights_version(42) == "/laminar/job1/weights/versions/000000000042"
    assert k.weights_version(9) < k.weights_version(10)
    assert k.election("relay-master") == "/laminar/job1/election/relay-master"


@pytest.mark.parametrize("bad", ["", "a/b", "../x", "-lead", "x" * 200])
def test_bad_names_refused(bad):
    with pytest.raises(ValueError):
        JobKeys("job").member("worker", bad)


def test_parse_foreign_key_refused():
    with pytest.raises(ValueError):
        JobKeys("job").parse_member("/laminar/other/members/worker/w")


def test_negative_version_refused():
    with pytest.raises(ValueError):
        JobKeys("job").weights_version(-1)
