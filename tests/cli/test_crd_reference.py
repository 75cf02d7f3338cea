"""docs/crd-reference.md is generated from crds/ and up to date."""

from trainop import crdref, crds


def test_reference_is_up_to_date():
    assert crdref.OUTPUT.read_text() == crdref.render(), "run: python -m trainop.crdref --write"


def test_reference_names_every_field_of_every_crd():
    text = crdref.render()

    def fields(node, path):
        for name, child in (node.get("properties") or {}).items():
            here = f"{path}.{name}"
            yield here
            if (child.get("items") or child).get("description", "").startswith("core/v1 "):
                continue  # Kubernetes' own type (coreschema.py): kubectl explain pod.spec
            yield from fields(child.get("items") if child.get("type") == "array" else child,
                              here + ("[]" if child.get("type") == "array" else ""))

    for kind in crds.load_all():
        schema = crds.schema(kind)
        for part in ("spec", "status"):
            for field in fields(schema["properties"][part], part):
                assert f"| `{field}` |" in text, field
