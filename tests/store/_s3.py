"""Helpers of the object-store tests (their fixtures, a moto S3 server on 127.0.0.1, are in
conftest.py over tests/_s3.py): what a bucket holds."""

from __future__ import annotations

from typing import Any

from tests._s3 import client


def keys(endpoint: str, bucket: str) -> list[str]:
    out = client(endpoint).list_objects_v2(Bucket=bucket)
    return sorted(o["Key"] for o in out.get("Contents", []))


def uploads(endpoint: str, bucket: str) -> list[Any]:
    return client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])
