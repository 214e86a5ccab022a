"""The JSON Schemas in spec/schema accept the documents the library writes and reject broken ones."""

from __future__ import annotations

import base64
import glob
import json
import pathlib

import jsonschema
import msgpack
import pytest

from tests.helpers.checkpoints import sample_state, save_sharded

SCHEMAS = pathlib.Path(__file__).resolve().parents[2] / "spec" / "schema"


def _jsonable(value):
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, msgpack.ExtType):
        return {"ext": value.code}
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def _load(path: str) -> dict:
    raw = open(path, "rb").read()
    return _jsonable(msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType))


def _validator(name: str) -> jsonschema.protocols.Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    url = str(tmp_path_factory.mktemp("schema") / "ck")
    state = dict(sample_state())
    save_sharded(state, url, 3, flat=("i",))
    return url


def test_written_documents_match_their_schemas(checkpoint: str) -> None:
    _validator("global-manifest.schema.json").validate(_load(glob.glob(f"{checkpoint}/manifest-*.msgpack")[0]))
    local = _validator("local-manifest.schema.json")
    for path in glob.glob(f"{checkpoint}/ranks/*.msgpack"):
        local.validate(_load(path))
    _validator("committed.schema.json").validate(json.load(open(f"{checkpoint}/COMMITTED")))


@pytest.mark.parametrize(
    "mutation",
    [
        lambda d: d.update(version=[1]),
        lambda d: d.update(attempt="../x"),
        lambda d: d.update(world_size=0),
        lambda d: d.pop("files"),
        lambda d: d["tensors"][0].update(dtype="F128"),
        lambda d: d["tensors"][0].update(layout="sparse"),
        lambda d: d["files"][0].update(data="/etc/passwd"),
    ],
)
def test_schema_rejects_broken_global_manifests(checkpoint: str, mutation) -> None:
    document = _load(glob.glob(f"{checkpoint}/manifest-*.msgpack")[0])
    mutation(document)
    with pytest.raises(jsonschema.ValidationError):
        _validator("global-manifest.schema.json").validate(document)


def test_committed_schema_rejects_a_traversal(checkpoint: str) -> None:
    marker = json.load(open(f"{checkpoint}/COMMITTED"))
    marker["manifest"] = "../manifest-abc.msgpack"
    with pytest.raises(jsonschema.ValidationError):
        _validator("committed.schema.json").validate(marker)


def test_a_piece_index_head_and_its_marker_match_their_schemas() -> None:
    """Format 1.2 (SPEC 11.1): the golden vector's head (the first msgpack document of its manifest) and COMMITTED."""
    case = pathlib.Path(__file__).resolve().parents[2] / "spec" / "vectors" / "valid" / "piece_index_basic"
    marker = json.loads((case / "COMMITTED").read_text())
    _validator("committed.schema.json").validate(marker)
    raw = (case / marker["manifest"]).read_bytes()[: marker["piece_index"]["head_size"]]
    head = _jsonable(msgpack.unpackb(raw, raw=False, strict_map_key=False, ext_hook=msgpack.ExtType))
    _validator("global-manifest.schema.json").validate(head)
    head["piece_index"]["first"]["enc"] = "zlib"
    with pytest.raises(jsonschema.ValidationError):
        _validator("global-manifest.schema.json").validate(head)
