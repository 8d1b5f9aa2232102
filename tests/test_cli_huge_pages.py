"""A command restarts itself once with glibc's huge-page tunable (jaxtrain/cli/huge_pages.py);
tests/test_cli.py runs real commands without it and reads the tunable in their start-up line."""

from jaxtrain.cli.huge_pages import environment_with_huge_pages

MADVISE = "always [madvise] never\n"


def with_pages(environ, **machine):
    return environment_with_huge_pages(
        environ, **{"system": "linux", "glibc": (2, 36), "thp_mode": MADVISE, **machine}
    )


def test_the_tunable_is_added_and_other_tunables_kept():
    assert with_pages({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    mine = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096"}
    assert with_pages(mine)["GLIBC_TUNABLES"] == (
        "glibc.malloc.trim_threshold=4096:glibc.malloc.hugetlb=1"
    )


def test_no_restart_where_it_would_change_nothing_or_the_user_chose():
    assert with_pages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None  # the opt-out
    assert with_pages({}, system="darwin") is None
    assert with_pages({}, glibc=(2, 31)) is None  # glibc before 2.35 ignores the tunable
    assert with_pages({}, glibc=(0, 0)) is None  # musl
    assert with_pages({}, thp_mode="always madvise [never]\n") is None
    assert with_pages({}, thp_mode="") is None  # a kernel without transparent huge pages
    assert with_pages({}, thp_mode="[always] madvise never\n") is not None
