"""The package's public names: every one in ``__all__`` imports, and the package is typed."""

from laminar_common.testing import assert_public_api


def test_every_public_name_imports_and_the_package_is_typed():
    assert_public_api("laminar_common")
