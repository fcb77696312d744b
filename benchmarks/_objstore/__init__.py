"""Helpers of bench_objstore.py: a moto S3 server on loopback that counts the bytes it moves."""
