"""Argument constraints: egress hosts, path prefixes, amount ceilings, recipient allowlists, and their parsing."""

from __future__ import annotations

import json

import pytest

from tether_tool_gateway.domain.constraints import (
    ConstraintsInvalid,
    check_constraints,
    parse_constraints,
)


def rules(*rs: dict) -> str:
    return json.dumps({"rules": list(rs)})


def violations(constraints_json: str, args) -> list[str]:
    return [v.describe() for v in check_constraints(parse_constraints(constraints_json), args)]


EGRESS = rules({"kind": "egress", "arg": "/url", "hosts": ["allowed.com", "*.docs.example.org", "bücher.example",
                                                            "127.0.0.1", "10.8.0.0/16", "[::1]"]})


# -- egress ------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", [
    "https://allowed.com/",
    "http://allowed.com/path?q=evil.com#frag",
    "https://ALLOWED.com/",
    "https://Allowed.COM./x",                     # trailing dot
    "https://allowed.com:8443/x",                 # any port unless ports are listed
    "https://api.docs.example.org/v1",            # subdomain wildcard
    "https://a.b.docs.example.org/",
    "https://bücher.example/",                    # IDN, as listed
    "https://xn--bcher-kva.example/",             # the same host as an A-label
    "https://ｂücher.example/",                    # fullwidth letters map (UTS #46) to the listed host
    "http://127.0.0.1:8080/x",                    # an IP literal that is listed
    "http://10.8.3.4/",                           # inside a listed network
    "http://[::1]:9000/",                         # IPv6 literal that is listed
    "HTTPS://allowed.com/",                       # scheme case
])
def test_urls_on_the_allowlist_pass(url):
    assert violations(EGRESS, {"url": url}) == []


@pytest.mark.parametrize("url,why", [
    ("http://allowed.com@evil.com/", "user information"),
    ("http://user:pw@allowed.com/", "user information"),
    ("http://evil.com/allowed.com", "'evil.com' is not on the egress allowlist"),
    ("http://evil.com?allowed.com", "'evil.com' is not on the egress allowlist"),
    ("http://evil.com#@allowed.com", "'evil.com' is not on the egress allowlist"),
    ("http://allowed.com.evil.com/", "not on the egress allowlist"),
    ("http://evilallowed.com/", "not on the egress allowlist"),
    ("http://docs.example.org/", "not on the egress allowlist"),      # the wildcard covers subdomains only
    ("http://аllowed.com/", "not on the egress allowlist"),           # Cyrillic 'а': a homograph
    ("http://evil.com\\@allowed.com/", "backslashes"),               # browsers read '\' as '/'
    ("http://allowed.com\\.evil.com/", "backslashes"),
    ("http://allowed.com /", "whitespace"),
    ("http://allowed.com\t.evil.com/", "whitespace"),
    ("ftp://allowed.com/", "scheme 'ftp' is not allowed"),
    ("file:///etc/passwd", "scheme 'file' is not allowed"),
    ("javascript://allowed.com/%0aalert(1)", "scheme 'javascript' is not allowed"),
    ("//allowed.com/", "not an absolute URL"),
    ("allowed.com", "not an absolute URL"),
    ("http:allowed.com", "not an absolute URL"),
    ("http://%61llowed.com/", "percent-encoding"),
    ("http://127.0.0.2/", "not on the egress allowlist"),
    ("http://localhost/", "not on the egress allowlist"),
    ("http://2130706434/", "'127.0.0.2' is not on the egress allowlist"),
    ("http://0x7f000002/", "not on the egress allowlist"),
    ("http://127.1.1.1.1/", "more than four parts"),
    ("http://[::2]/", "not on the egress allowlist"),
    ("http://[::1/", "IPv6"),
    ("http://allowed.com:99999/", "not a valid port"),
    ("http://allowed.com:80x/", "not a valid port"),
    ("http:///x", "empty"),
    ("http://-1.2.3.4/", "not a valid one"),              # int() takes a sign; an address does not
    ("http://127.0.0.+1/", "not a valid host name"),
    ("http://1_27.0.0.1/", "not a valid one"),            # nor '_'
    ("http://127.0.0.1:\u00b2/", "not a valid port"),        # '²' is a digit to str.isdigit
    ("http://127.0.0.1:+80/", "not a valid port"),
    ("http://127.0.0.\u00b2/", "'127.0.0.2' is not on the egress"),  # UTS #46 maps '²' to '2': an IP, as parsers read it
])
def test_urls_off_the_allowlist_or_ambiguous_are_violations(url, why):
    found = violations(EGRESS, {"url": url})
    assert len(found) == 1 and why in found[0], found
    assert found[0].startswith("argument /url breaks the egress rule")


def test_decimal_and_short_ip_forms_are_read_as_the_address_they_are():
    c = rules({"kind": "egress", "arg": "/url", "hosts": ["127.0.0.1"]})
    for url in ("http://2130706433/", "http://127.1/", "http://0x7f.0.0.1/", "http://0177.0.0.1/"):
        assert violations(c, {"url": url}) == [], url


def test_star_allows_names_but_not_ip_literals_localhost_or_intranet_names():
    c = rules({"kind": "egress", "arg": "/url", "hosts": ["*"]})
    assert violations(c, {"url": "https://anything.example/"}) == []
    for url in ("http://127.0.0.1/", "http://[::1]/", "http://localhost/", "http://db.localhost/", "http://intranet/"):
        assert violations(c, {"url": url}) != [], url


def test_schemes_and_ports_can_be_narrowed():
    c = rules({"kind": "egress", "arg": "/url", "hosts": ["allowed.com"], "schemes": ["https"], "ports": [443]})
    assert violations(c, {"url": "https://allowed.com/"}) == []
    assert "scheme 'http'" in violations(c, {"url": "http://allowed.com/"})[0]
    assert "port 8443 is not allowed" in violations(c, {"url": "https://allowed.com:8443/"})[0]


def test_a_non_string_url_is_a_violation():
    assert "not a URL string" in violations(EGRESS, {"url": 5})[0]
    assert "not a URL string" in violations(EGRESS, {"url": {"href": "https://allowed.com/"}})[0]


# -- argument selection ------------------------------------------------------------------------
def test_rules_apply_to_every_array_element_and_wildcard_path():
    c = rules({"kind": "egress", "arg": "/urls", "hosts": ["allowed.com"]},
              {"kind": "egress", "arg": "/attachments/*/href", "hosts": ["allowed.com"]})
    args = {"urls": ["https://allowed.com/a", "https://evil.com/b"],
            "attachments": [{"href": "https://allowed.com/1"}, {"href": "https://evil.com/2"}]}
    found = violations(c, args)
    assert [f.split(" breaks")[0] for f in found] == ["argument /urls/1", "argument /attachments/1/href"]


def test_a_missing_argument_is_left_to_the_schema():
    assert violations(EGRESS, {"other": "x"}) == []


def test_pointer_escapes():
    c = rules({"kind": "max_amount", "arg": "/a~1b/c~0d", "max": 5})
    assert violations(c, {"a/b": {"c~d": 6}})[0].startswith("argument /a~1b/c~0d")


# -- paths -------------------------------------------------------------------------------------
PATHS = rules({"kind": "path_prefix", "arg": "/path", "prefixes": ["/srv/reports"]})


@pytest.mark.parametrize("path", ["/srv/reports", "/srv/reports/", "/srv/reports/2024/q1.csv",
                                  "/srv/reports/./a//b", "/srv/reports/x/../y", "//srv/reports/z"])
def test_paths_under_the_prefix_pass(path):
    assert violations(PATHS, {"path": path}) == []


@pytest.mark.parametrize("path,why", [
    ("/srv/reports/../secrets", "'/srv/secrets'"),
    ("/srv/reports/../../etc/passwd", "'/etc/passwd'"),
    ("/srv/reportsX/file", "not under"),          # a prefix is a directory, not a string prefix
    ("/srv/report", "not under"),
    ("reports/a", "must be absolute"),
    ("/srv/reports/a\x00.csv", "NUL"),
    ("/srv/reports\\..\\..\\etc", "backslash"),
    ("", "empty"),
])
def test_paths_escaping_the_prefix_are_violations(path, why):
    found = violations(PATHS, {"path": path})
    assert len(found) == 1 and why in found[0], found


def test_relative_paths_resolve_against_the_base():
    c = rules({"kind": "path_prefix", "arg": "/path", "prefixes": ["/work/run"], "base": "/work/run"})
    assert violations(c, {"path": "out/a.txt"}) == []
    assert "'/work/secrets'" in violations(c, {"path": "../secrets"})[0]


# -- amounts -----------------------------------------------------------------------------------
AMOUNT = rules({"kind": "max_amount", "arg": "/amount", "max": "250.00"})


@pytest.mark.parametrize("amount", [0, 1, 250, 249.99, "250", "250.00", "0.01", "12.5"])
def test_amounts_within_the_ceiling_pass(amount):
    assert violations(AMOUNT, {"amount": amount}) == []


@pytest.mark.parametrize("amount,why", [
    (250.01, "exceeds the ceiling"),
    ("250.001", "exceeds the ceiling"),
    ("1e3", "not a plain number"),
    ("$100", "not a plain number"),
    ("1,000", "not a plain number"),
    (" 100", "not a plain number"),
    ("100 USD", "not a plain number"),
    ("NaN", "not a plain number"),
    ("Infinity", "not a plain number"),
    (True, "not a plain number"),
    (None, "not a plain number"),
    ({"value": 1}, "not a plain number"),
    (-5, "below the minimum"),
    ("-0.01", "below the minimum"),
    (10**30, "exceeds the ceiling"),
])
def test_amounts_over_the_ceiling_or_unreadable_are_violations(amount, why):
    found = violations(AMOUNT, {"amount": amount})
    assert len(found) == 1 and why in found[0], found


def test_a_rule_can_allow_negative_amounts():
    c = rules({"kind": "max_amount", "arg": "/amount", "max": 10, "min": "-10"})
    assert violations(c, {"amount": -10}) == [] and violations(c, {"amount": "-10.5"}) != []


# -- recipients --------------------------------------------------------------------------------
RECIPIENTS = rules({"kind": "recipients", "arg": "/to", "domains": ["example.com", "*.corp.example"],
                    "addresses": ["Partner Desk <desk@partner.org>"]})


@pytest.mark.parametrize("to", [
    "bob@example.com",
    "Bob@EXAMPLE.com",
    "Bob <bob@example.com>",
    '"Smith, Bob" <bob@example.com>',
    "bob@example.com, alice@example.com",
    "bob@example.com; ops@eu.corp.example",
    "desk@partner.org",
    "DESK@Partner.org",
    "bob@example.com.",
])
def test_recipients_on_the_allowlist_pass(to):
    assert violations(RECIPIENTS, {"to": to}) == []


@pytest.mark.parametrize("to,why", [
    ("attacker@evil.example", "'attacker@evil.example' is not on the allowlist"),
    ("Bob <attacker@evil.example>", "not on the allowlist"),
    ("bob@example.com, attacker@evil.example", "'attacker@evil.example' is not on the allowlist"),
    ("bob@example.com <attacker@evil.example>", "special characters"),
    ('"bob@example.com" <attacker@evil.example>', "looks like an address"),
    ('"attacker@evil.example" <bob@example.com>', "looks like an address"),
    ("bob@example.com (attacker@evil.example)", "comments"),
    ("bob@example.com@evil.example", "not a plain address"),
    ('"bob@example.com"@evil.example', "not a plain address"),
    ("bob@corp.example", "not on the allowlist"),        # '*.corp.example' is subdomains only
    ("bob@example.com.evil.example", "not on the allowlist"),
    ("bob@exаmple.com", "not on the allowlist"),         # Cyrillic 'а'
    ("bob@[127.0.0.1]", "not a plain address"),
    ("bob@127.0.0.1", "IP address"),
    ("bob@localhost", "not on the allowlist"),
    ("bob@example.com\r\nBcc: attacker@evil.example", "control characters"),
    ("Bob <bob@example.com", "unterminated"),
    ("", "no recipient"),
    ("desk2@partner.org", "not on the allowlist"),
])
def test_recipients_off_the_allowlist_or_ambiguous_are_violations(to, why):
    found = violations(RECIPIENTS, {"to": to})
    assert len(found) == 1 and why in found[0], found


def test_a_list_of_recipients_is_checked_element_by_element():
    found = violations(RECIPIENTS, {"to": ["bob@example.com", "x@evil.example"]})
    assert len(found) == 1 and found[0].startswith("argument /to/1 breaks the recipients rule")


# -- parsing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["{}", "", '{"rules": []}'])
def test_no_constraints(text):
    assert parse_constraints(text).rules == []


@pytest.mark.parametrize("text,why", [
    ("not json", "not JSON"),
    ('{"rules": [{"kind": "teleport", "arg": "/x"}]}', "kind"),
    ('{"rules": [{"kind": "egress", "arg": "/url", "hosts": []}]}', "hosts"),
    ('{"rules": [{"kind": "egress", "arg": "/url", "hosts": ["a"], "schemes": ["ftp"]}]}', "schemes"),
    ('{"rules": [{"kind": "egress", "arg": "url", "hosts": ["a"]}]}', "JSON pointer"),
    ('{"rules": [{"kind": "path_prefix", "arg": "/p", "prefixes": ["relative"]}]}', "absolute"),
    ('{"rules": [{"kind": "max_amount", "arg": "/a", "max": "lots"}]}', "max"),
    ('{"rules": [{"kind": "recipients", "arg": "/to", "domain": ["x"]}]}', "domain"),
    ('{"rule": []}', "rule"),
])
def test_invalid_constraints_are_refused_with_the_reason(text, why):
    with pytest.raises(ConstraintsInvalid) as err:
        parse_constraints(text)
    assert why in str(err.value)
