"""A real S3 API server for tests: moto's ThreadedMotoServer on 127.0.0.1 and fresh buckets.

    with s3_server() as endpoint:            # "http://127.0.0.1:PORT", AWS_* env set meanwhile
        bucket = new_bucket(endpoint)
        opts = s3_options(endpoint)           # storage_options for s3fs

Child processes (tests/_dist.py) get ``endpoint`` and build the same options; they need no
environment.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from typing import Any

ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """Start a moto S3 server on a free loopback port; yield its endpoint URL."""
    from moto.server import ThreadedMotoServer

    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs storage_options for the test server."""
    return {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}


def client(endpoint: str) -> Any:
    """A boto3 S3 client of the test server."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def new_bucket(endpoint: str) -> str:
    """Create a bucket with a fresh name; return the name."""
    name = f"b-{uuid.uuid4().hex[:12]}"
    client(endpoint).create_bucket(Bucket=name)
    return name
