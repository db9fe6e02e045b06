"""unique_name gives collision-free names in the shapes Kafka and PostgreSQL accept."""

from __future__ import annotations

import re

from tether_testing import unique_name


def test_unique_names_differ_and_keep_the_prefix():
    names = {unique_name("orders") for _ in range(100)}
    assert len(names) == 100
    assert all(re.fullmatch(r"orders-[0-9a-f]{12}", n) for n in names)


def test_separator_for_sql_identifiers():
    assert re.fullmatch(r"t_[0-9a-f]{12}", unique_name("t", sep="_"))
