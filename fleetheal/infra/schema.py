"""What a JSON Schema can say about a stack setting (fields, types, ranges, patterns), checked by `jsonschema`,
with the messages a person fixing a stack file needs.

A schema's property may carry `x-hint` (how to fix a bad value: "use an integer from 1 to 16"); the error
then reads `WHERE.FIELD: VALUE is not accepted; HINT`. Unknown and missing fields are named with the
accepted ones. Rules between fields (unique names, enough standby nodes) stay code beside the schema.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Which error a reader meets first: the object's shape, then its fields in the schema's order.
_SHAPE_FIRST = {"type": 0, "additionalProperties": 1, "required": 2}


def errors(schema: Mapping[str, Any], value: Any, where: str, context: str = "") -> list[tuple[str, str]]:
    """(field, message) of each way `value` breaks `schema`, the one to report first first; field is ""
    for the object's shape. `context` follows the unknown-field list (e.g. "for nodeProvider=eks")."""
    import jsonschema  # at the first check: `fleetheal --help` does not pay for it

    validator = jsonschema.Draft202012Validator(schema)
    order = list((schema.get("properties") or {}).keys())
    accepted = ", ".join(order)
    found: list[tuple[tuple[int, int], str, str]] = []
    for err in validator.iter_errors(value):
        if not err.path:
            if err.validator == "additionalProperties":
                unknown = sorted(set(value) - set(order))
                extra = f" {context}" if context else ""
                msg = f"{where}: unknown field(s) {', '.join(unknown)}{extra}; accepted fields: {accepted}"
            elif err.validator == "required":
                missing = [k for k in schema.get("required", ()) if k not in value]
                msg = f"{where}: missing field(s) {', '.join(missing)}; accepted fields: {accepted}"
            else:
                msg = f"{where}: expected an object with {accepted}, got {value!r}"
            found.append(((_SHAPE_FIRST.get(str(err.validator), 0), 0), "", msg))
            continue
        name = str(err.path[0])
        prop = (schema.get("properties") or {}).get(name) or {}
        hint = prop.get("x-hint") or err.message
        msg = f"{where}.{name}: {value[name]!r} is not accepted; {hint}"
        found.append(((3, order.index(name) if name in order else len(order)), name, msg))
    found.sort(key=lambda f: f[0])
    return [(name, msg) for _, name, msg in found]
