"""The `format` checks the gateway asserts: after the RFCs JSON Schema 2020-12 names, with no optional package."""

from __future__ import annotations

import pytest
from jsonschema import Draft202012Validator, FormatChecker

from tether_security.argument_formats import FORMAT_CHECKS
from tether_security.argument_schema import argument_validator, format_checker

# (value, valid), after the JSON-Schema-Test-Suite's draft2020-12 optional/format cases.
CASES: dict[str, list[tuple[str, bool]]] = {
    "email": [
        ("joe.bloggs@example.com", True), ("te~st@example.com", True), ('"joe bloggs"@example.com', True),
        ('"\\""@iana.org', True), ("joe.bloggs@[127.0.0.1]", True), ("joe.bloggs@[IPv6:::1]", True),
        ("test@io", True), ("test@c--n.com", True),
        ("2962", False), (".test@example.com", False), ("te..st@example.com", False), ("a@b@c.org", False),
        ("joe.bloggs@invalid=domain.com", False), ("joe.bloggs@[127.0.0.300]", False), ("a\u00e9@iana.org", False),
        ("user1@oceania.org, user2@oceania.org", False), ('"Winston" <w@recdep.minitrue>', False),
        ("test@iana.org\n", False), ("test@-iana.org", False), ("test@iana.org.", False), ("a@[]", False),
        ("test(comment)@iana.org", False), ("", False),
    ],
    "uri": [
        ("http://foo.bar/?baz=qux#quux", True), ("http://-.~_!$&'()*+,;=:%40:80%2f::::::@example.com", True),
        ("ldap://[2001:db8::7]/c=GB?objectClass?one", True), ("mailto:John.Doe@example.com", True),
        ("urn:oasis:names:specification:docbook:dtd:xml:4.1.2", True), ("http://a.com:", True), ("http://user@", True),
        ("//foo.bar/?baz=qux#quux", False), ("/abc", False), ("abc", False), ("http:// shouldfail.com", False),
        ("bar,baz:foo", False), ("https://[@example.org/test.txt", False), ("https://example.org/foobar\u00ae.txt", False),
        ("https://example.org/foobar<>.txt", False), ("http://example.com/%6G", False), ("http://a.com:8:0", False),
        ("http://[fe80::1%25eth0]/", False), ("1http://example.com", False),
    ],
    "date-time": [
        ("1963-06-19T08:30:06.283185Z", True), ("1937-01-01T12:00:27.87+00:20", True), ("1998-12-31T23:59:60Z", True),
        ("1998-12-31T15:59:60.123-08:00", True), ("1963-06-19t08:30:06.283185z", True),
        ("1998-12-31T23:58:60Z", False), ("1990-02-31T15:59:59.123-08:00", False), ("1990-12-31T15:59:59-24:00", False),
        ("1963-06-19T08:30:06.28123+01:00Z", False), ("2013-350T01:01:01", False), ("1963-06-1\u09eaT00:00:00Z", False),
        ("2026-12-01 09:30:00Z", False), ("2026-12-01T09:30:00", False),
    ],
    "date": [("2020-02-29", True), ("0400-02-29", True), ("2021-02-29", False), ("2100-02-29", False),
             ("2020-04-31", False), ("20230328", False), ("2020-01-01Z", False), ("\u09e8020-01-01", False)],
    "time": [("08:30:06Z", True), ("01:29:60+01:30", True), ("00:29:60-23:30", True), ("12:34:56-00:00", True),
             ("23:59:60+01:00", False), ("12:00:00", False), ("24:00:00Z", False), ("08:30:06+0130", False)],
    "ipv4": [("192.168.0.1", True), ("0.0.0.0", True), ("087.10.0.1", False), ("127.1", False), ("2130706433", False),
             ("1\u09e87.0.0.1", False), ("192.168.0.1\n", False), ("256.256.256.256", False)],
    "ipv6": [("::1", True), ("1::d6:192.168.0.1", True), ("::ffff:192.168.0.1", True), ("::", True),
             ("12345::", False), ("1::d6::42", False), ("fe80::a%eth1", False), ("  ::1", False),
             ("1:2::192.168.256.1", False), ("1:2:3:4:5:6:7:\u09ea", False), ("127.0.0.1", False)],
    "uuid": [("2EB8AA08-AA98-11EA-B4AA-73B441D16380", True), ("00000000-0000-0000-0000-000000000000", True),
             ("2eb8aa08aa9811eab4aa73b441d16380", False), ("2eb8aa0-8aa98-11e-ab4aa7-3b441d16380", False),
             ("urn:uuid:2eb8aa08-aa98-11ea-b4aa-73b441d16380", False)],
}


@pytest.mark.parametrize(("fmt", "value", "valid"), [(f, v, ok) for f, cases in CASES.items() for v, ok in cases])
def test_each_format_accepts_what_its_rfc_does(fmt, value, valid):
    assert FORMAT_CHECKS[fmt](value) is valid
    schema = {"type": "object", "properties": {"v": {"format": fmt}}}
    assert argument_validator(schema, [fmt]).is_valid({"v": value}) is valid


def test_every_assertable_format_is_tested():
    assert set(CASES) == set(FORMAT_CHECKS)


def test_the_checks_are_the_gateways_own_not_jsonschemas():
    # jsonschema's "email" is "has an @"; its "uri" and "date-time" pass everything unless an optional
    # package happens to be installed. The verdict must not depend on either.
    assert FormatChecker().conforms("a@b@c.org", "email") and not FORMAT_CHECKS["email"]("a@b@c.org")
    schema = {"type": "object", "properties": {"to": {"format": "email"}, "at": {"format": "date-time"}}}
    assert not argument_validator(schema, ["email"]).is_valid({"to": "a@b@c.org"})
    assert argument_validator(schema, ["email"]).is_valid({"at": "no"})  # not asserted: an annotation


def test_format_is_an_annotation_unless_asserted_and_never_applies_to_other_types():
    schema = {"type": "object", "properties": {"to": {"format": "email"}}}
    assert argument_validator(schema).is_valid({"to": "nope"})
    assert Draft202012Validator(schema).is_valid({"to": "nope"})
    for not_a_string in (5, None, ["x"], {"a": 1}):
        assert argument_validator(schema, ["email"]).is_valid({"to": not_a_string})


def test_a_format_that_cannot_be_asserted_is_refused():
    with pytest.raises(ValueError, match="cannot assert format 'hostname'"):
        format_checker(["email", "hostname"])
