"""The sha256 an export carries of itself: every byte of the file before the record, kept at its end.

- ``.pt2`` (a zip archive): the record is the archive's comment (the zip format's own field at the
  very end of the file, after the end-of-central-directory record), ``pagedpack-sha256:<hex>``;
  the digest covers every byte before the comment's 2-byte length field, so the weights, the graph,
  the metadata and the zip directory are all covered. ``torch.export.load`` and ``zipfile`` read
  such an archive as before.
- ``.onnx`` (a protobuf ``ModelProto``): the record is one more ``metadata_props`` entry
  (``pagedpack.sha256``) serialized after the model; protobuf merges a message from concatenated
  encodings, so the file parses as the model with that entry, and the digest covers every byte
  before it. A model above 2 GB keeps its tensors in ``<file>.data``, whose sha256 is one more
  entry before the record.

:func:`seal_pt2` / :func:`seal_onnx` add the record to a file just written (before it is renamed
into place); :func:`verify_pt2` / :func:`verify_onnx` check it at load and raise ``ValueError``
naming the file on a mismatch or a missing record. Cost: one sha256 pass over the file (its
speed on this project's machine: README, "Trust and files").
"""
from __future__ import annotations

import hashlib
import os
import struct

from pagedpack.formats.files import sha256_file, sha256_of

PREFIX = b"pagedpack-sha256:"
ONNX_KEY = "pagedpack.sha256"
DATA_KEY = "pagedpack.data.sha256"  # an ONNX model's external data file (models above 2 GB)
_EOCD = b"PK\x05\x06"  # zip end-of-central-directory signature; the record is 22 bytes + comment
_EOCD_SIZE = 22
_COMMENT_SIZE = len(PREFIX) + 64


def seal_pt2(path: str) -> None:
    """Append the sha256 record to the zip file ``path``, which must have no comment yet."""
    with open(path, "r+b") as file:
        size = file.seek(0, 2)
        file.seek(size - _EOCD_SIZE)
        eocd = file.read(_EOCD_SIZE)
        if eocd[:4] != _EOCD or eocd[20:22] != b"\0\0":
            raise ValueError(f"path: {path!r} does not end in a zip directory without a comment; cannot seal it")
        digest = sha256_of(file, size - 2)
        file.seek(size - 2)
        file.write(struct.pack("<H", _COMMENT_SIZE) + PREFIX + digest.encode("ascii"))


def verify_pt2(file, path: str) -> None:
    """Check the sha256 record of the ``.pt2`` archive open as ``file`` (named ``path`` in errors)."""
    size = file.seek(0, 2)
    tail = _EOCD_SIZE + _COMMENT_SIZE
    file.seek(max(0, size - tail))
    record = file.read(tail)
    if (len(record) < tail or record[:4] != _EOCD or record[20:22] != struct.pack("<H", _COMMENT_SIZE)
            or not record[_EOCD_SIZE:].startswith(PREFIX)):
        raise ValueError(f"path: {path!r} carries no pagedpack checksum (not written by this version of "
                         f"'pagedpack export', or cut short: {size} bytes); export it again")
    recorded = record[_EOCD_SIZE + len(PREFIX):].decode("ascii", "replace")
    _compare(path, recorded, sha256_of(file, size - 2 - _COMMENT_SIZE))


def seal_onnx(path: str, data_path: str | None = None) -> None:
    """Append the sha256 record to the serialized ``ModelProto`` at ``path``; with ``data_path``
    (its external data file), first an entry ``pagedpack.data.sha256`` with that file's sha256,
    which the record then covers."""
    with open(path, "r+b") as file:
        file.seek(0, 2)
        if data_path is not None:
            file.write(_onnx_record(sha256_file(data_path), DATA_KEY))
        digest = sha256_of(file)
        file.seek(0, 2)
        file.write(_onnx_record(digest))


def verify_onnx(data: bytes, props: dict[str, str], path: str) -> None:
    """Check the sha256 record of the ONNX file whose bytes are ``data`` and parsed metadata ``props``."""
    recorded = props.get(ONNX_KEY)
    record = _onnx_record(recorded) if isinstance(recorded, str) else None
    if record is None or not data.endswith(record):
        raise ValueError(f"path: {path!r} carries no pagedpack checksum (not written by this version of "
                         f"'pagedpack export', or cut short: {len(data)} bytes); export it again")
    _compare(path, recorded, hashlib.sha256(memoryview(data)[:len(data) - len(record)]).hexdigest())


def verify_onnx_data(model, props: dict[str, str], path: str) -> None:
    """An ONNX model whose tensors live in an external data file: that file is ``<path>.data``
    (the only one pagedpack writes; any other location is refused) and its sha256 is the one the
    model records (``pagedpack.data.sha256``, covered by the model's own record)."""
    locations = {entry.value for tensor in _tensor_protos(model) if tensor.data_location == tensor.EXTERNAL
                 for entry in tensor.external_data if entry.key == "location"}
    if not locations:
        return
    expected = os.path.basename(path) + ".data"
    if locations != {expected}:
        raise ValueError(f"path: {path!r} keeps tensors in {sorted(locations)[:3]}; expected only its own data file "
                         f"{expected!r}")
    recorded = props.get(DATA_KEY)
    data_path = os.path.join(os.path.dirname(os.path.abspath(path)), expected)
    if not isinstance(recorded, str):
        raise ValueError(f"path: {path!r} records no sha256 of its data file {expected!r}; export it again")
    _compare(data_path, recorded, sha256_file(data_path))


def _tensor_protos(message):
    """Every ``TensorProto`` inside the protobuf ``message``: initializers, sparse initializers'
    values and indices, attributes, in subgraphs and functions alike (onnx's own helper skips the
    sparse ones)."""
    for field, value in message.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        for item in ((value,) if hasattr(value, "DESCRIPTOR") else value):  # a message, or a repeated field of them
            if item.DESCRIPTOR.name == "TensorProto":
                yield item
            else:
                yield from _tensor_protos(item)


def _onnx_record(digest: str, key: str = ONNX_KEY) -> bytes:
    import onnx

    model = onnx.ModelProto()
    entry = model.metadata_props.add()
    entry.key, entry.value = key, digest
    return model.SerializeToString()


def _compare(path: str, recorded: str, actual: str) -> None:
    if recorded != actual:
        raise ValueError(f"path: {path!r} is damaged: its contents have sha256 {actual}, the file records "
                         f"{recorded:.64}; it was changed or corrupted after it was written (export it again)")
