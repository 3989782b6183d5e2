"""The node-health agent: NVML, kernel log and training signals -> classified faults, metrics, fast path.

Importing this package pulls in only the standard library, PyYAML and the taxonomy; prometheus-client and
pynvml are imported where they are used, and never Pulumi, Ansible or aiohttp.
"""
