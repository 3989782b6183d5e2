"""Turn log text (kernel log, training logs) into classified fault events.

Formats, not strings: every matcher keys on the stable part of a message (the driver's `NVRM: Xid (...)`
record, the AER severity words, the PyTorch/CUDA error text) and ignores whatever prefix the log pipeline
added (syslog, `dmesg -T`, `dmesg -x`, `/dev/kmsg` records, journald). Classification comes only from the
taxonomy. A line that merely gives context to another (a GSP buffer dump, a board serial, a stack frame)
yields no event.

A failing node floods its log, so the common case (a line that matches nothing) must be cheap: plain
substring tests reject it before any detailed pattern runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from fleetheal.taxonomy import Fault, Taxonomy, load


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One fault found in a log line."""

    fault: Fault
    xid: int | None = None
    pci_bus_id: str | None = None  # as written in the log (without the `PCI:` tag), or None
    pid: int | None = None
    process: str | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, object]:
        d: dict[str, object] = self.fault.as_dict()
        d["xid"] = self.xid
        d["pci_bus_id"] = self.pci_bus_id
        d["pid"] = self.pid
        d["process"] = self.process
        d["detail"] = self.detail
        return d


_BUS = r"[0-9A-Fa-f]{2,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}(?:\.[0-7])?"
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<bus>" + _BUS + r")\): (?P<code>\d+)"
    r"(?:, pid=(?P<pid>'<unknown>'|<unknown>|\d+), name=(?P<name>[^,]*))?"
    r"(?:, (?P<rest>.*))?"
)
_SXID = re.compile(r"SXid \((?:PCI:)?(?P<bus>" + _BUS + r")\): (?P<code>\d+), (?P<sev>Non-fatal|Fatal)")
_FM_SXID = re.compile(
    r"detected NVSwitch (?P<sev>non-fatal|fatal) error (?P<code>\d+).*?pci bus id (?P<bus>[0-9A-Fa-f:.]+)"
)
_CAUSED_BY = re.compile(r"caused by previous Xid (\d+)")
_NVLINK5_REGS = re.compile(r"\((0x[0-9A-Fa-f]{1,8}) (0x[0-9A-Fa-f]{1,8})")
_NVLINK5_SEV = re.compile(r"\b(Non-fatal|Nonfatal|Fatal)\b", re.IGNORECASE)
_RECOVERY = re.compile(r"recovery action changed from \S+ \([^)]*\) to \S+ \((?P<to>[^)]*)\)", re.IGNORECASE)
_FALLEN = re.compile(r"GPU (?:at PCI:)?(?P<bus>" + _BUS + r"): GPU has fallen off the bus")
_GSP_TIMEOUT = re.compile(r"Timeout after \d+s of waiting for RPC response from GPU\d+ GSP|rpcRecvPoll timedout")
_NVLINK_FAIL = re.compile(
    r"NVRM: .*(?:knvlink|nvlink|NVLink)\w*.*\b(?:failed|fatal error|training fail)", re.IGNORECASE
)
_NCCL_TIMEOUT = re.compile(r"Watchdog caught collective operation timeout|collective operation timeout|NCCL timeout")
_NCCL_EXC = re.compile(r"NCCL watchdog thread terminated with exception: (?P<exc>.*)")
_CUDA_ECC = re.compile(r"uncorrectable ECC error encountered|cudaErrorECCUncorrectable|CUDA_ERROR_ECC_UNCORRECTABLE")
_CUDA_ILLEGAL = re.compile(
    r"an illegal memory access was encountered|cudaErrorIllegalAddress|CUDA_ERROR_ILLEGAL_ADDRESS"
)
_CUDA_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory|cudaErrorMemoryAllocation")
_AER = re.compile(
    r"(?:PCIe Bus Error: severity=|AER: (?:Multiple )?)"
    r"(?P<sev>Corrected|Uncorrect(?:ed|able) \((?:Non-Fatal|Fatal)\))"
)
_AER_FROM = re.compile(r"received from (?P<bus>" + _BUS + r")")
_DEV_PREFIX = re.compile(r"(?:^|\s)[\w-]+ (?P<bus>[0-9A-Fa-f]{4}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7]):")
_EDAC_UE = re.compile(r"EDAC .*\b(?:UE|[Uu]ncorrect(?:ed|able))\b|Uncorrected hardware memory error|Memory failure: ")
_EDAC_CE = re.compile(r"EDAC .*\b(?:CE|[Cc]orrected)\b")
_MCE_MEM = re.compile(r"MCE MEMORY ERROR|mce: \[Hardware Error\]: .*[Mm]emory")
_NIC_DOWN = re.compile(r"NIC Link is Down|\b(?:mlx5_core|mlx4_en|bnxt_en|ice|i40e|ixgbe|igb|ena|gve)\b.*\bLink down\b")
_NAN_LOSS = re.compile(r"\b[Ll]oss\b[^\n]{0,24}?\b(?:nan|NaN|NAN|inf|Inf|INF)\b")

_CUDA = (
    (_CUDA_ECC, "cuda-ecc-uncorrectable"),
    (_CUDA_ILLEGAL, "cuda-illegal-address"),
    (_CUDA_OOM, "cuda-oom"),
)
_HOST_MEMORY = (
    (_EDAC_UE, "host-memory-ue"),
    (_MCE_MEM, "host-mce-memory"),
    (_EDAC_CE, "host-memory-ce"),
)

_RECOVERY_FAULTS = {
    "gpu reset required": "xid-154-gpu-reset",
    "drain and reset": "xid-154-gpu-reset",
    "node reboot required": "xid-154-node-reboot",
    "drain p2p": "xid-154-drain-p2p",
}


class LogParser:
    """Parses lines against one taxonomy (the shipped one by default)."""

    def __init__(self, taxonomy: Taxonomy | None = None) -> None:
        self.tx = taxonomy or load()
        # A flooded log is mostly lines we must reject fast: substring tests pick the one matcher
        # worth running. Order matters where two can match (an NCCL exception naming an ECC error).
        self._dispatch: tuple[tuple[str, Callable[[str], FaultEvent | None]], ...] = (
            ("fallen off the bus", self._fallen),
            ("SXid (", self._sxid),
            ("NVSwitch", self._fm_sxid),
            ("atchdog", self._nccl),
            ("NCCL timeout", self._nccl),
            ("ECC", self._cuda),
            ("llegal", self._cuda),
            ("ILLEGAL", self._cuda),
            ("emory", self._cuda_or_host),
            ("GSP", self._gsp),
            ("rpcRecvPoll", self._gsp),
            ("NVRM", self._nvlink),
            ("AER", self._aer),
            ("PCIe Bus Error", self._aer),
            ("EDAC", self._host_memory),
            ("No space left on device", self._disk_full),
            ("ink", self._nic),
            ("oss", self._nan_loss),
        )

    def parse_line(self, line: str) -> list[FaultEvent]:
        """Every fault in `line` (usually zero or one)."""
        pos = line.find("NVRM: Xid (")
        if pos >= 0:
            m = _XID.match(line, pos)
            if m:
                return [self._xid_event(m)]
        for keyword, matcher in self._dispatch:
            if keyword in line:
                event = matcher(line)
                if event is not None:
                    return [event]
        return []

    def parse_lines(self, lines: Iterable[str]) -> Iterator[tuple[int, FaultEvent]]:
        """(1-based line number, event) for every fault in `lines`."""
        for number, line in enumerate(lines, start=1):
            for event in self.parse_line(line):
                yield number, event

    def _xid_event(self, m: re.Match[str]) -> FaultEvent:
        bus = m.group("bus")
        code = int(m.group("code"))
        pid_text = m.group("pid")
        pid = int(pid_text) if pid_text and pid_text.isdigit() else None
        name = m.group("name")
        process = name if name and name != "<unknown>" else None
        rest = (m.group("rest") or "").rstrip()
        fault = self.tx.for_xid(code)
        if 144 <= code <= 150:
            fault = self._nvlink5(code, rest, fault)
        elif code == 154:
            r = _RECOVERY.search(rest)
            if r:
                fault = self.tx.faults.get(_RECOVERY_FAULTS.get(r.group("to").strip().lower(), ""), fault)
        detail = rest
        caused = _CAUSED_BY.search(rest) if "caused by" in rest else None
        if caused:
            detail = f"{rest} (sympathetic: caused by Xid {caused.group(1)})"
        return FaultEvent(fault, xid=code, pci_bus_id=bus, pid=pid, process=process, detail=detail)

    def _nvlink5(self, code: int, rest: str, default: Fault) -> Fault:
        regs = _NVLINK5_REGS.search(rest)
        if regs:
            decoded = self.tx.decode_nvlink5(code, int(regs.group(1), 16), int(regs.group(2), 16))
            if decoded is not None:
                return decoded
        # No decode row matched: trust the driver's own word, if it gave one.
        sev = _NVLINK5_SEV.search(rest)
        if sev:
            word = sev.group(1).lower()
            variant = f"xid-{code}-observe" if word.startswith("non") else f"xid-{code}-reset-gpu"
            return self.tx.faults.get(variant, default)
        return default

    def _fallen(self, line: str) -> FaultEvent | None:
        m = _FALLEN.search(line)
        if m is None:
            return None
        return FaultEvent(self.tx.faults["gpu-lost"], pci_bus_id=m.group("bus"), detail="GPU has fallen off the bus")

    def _sxid(self, line: str) -> FaultEvent | None:
        m = _SXID.search(line)
        if m is None:
            return None
        fid = "nvswitch-sxid-fatal" if m.group("sev") == "Fatal" else "nvswitch-sxid-nonfatal"
        return FaultEvent(self.tx.faults[fid], pci_bus_id=m.group("bus"), detail=f"SXid {m.group('code')}")

    def _fm_sxid(self, line: str) -> FaultEvent | None:
        m = _FM_SXID.search(line)
        if m is None:
            return None
        fid = "nvswitch-sxid-fatal" if m.group("sev") == "fatal" else "nvswitch-sxid-nonfatal"
        return FaultEvent(self.tx.faults[fid], pci_bus_id=m.group("bus"), detail=f"SXid {m.group('code')}")

    def _nccl(self, line: str) -> FaultEvent | None:
        m = _NCCL_EXC.search(line)
        if m:  # the watchdog died of something else: that something decides
            exc = m.group("exc")
            return self._cuda(exc) or FaultEvent(self.tx.faults["nccl-timeout"], detail=_tail(exc))
        if _NCCL_TIMEOUT.search(line):
            return FaultEvent(self.tx.faults["nccl-timeout"], detail=_tail(line))
        return None

    def _cuda(self, text: str) -> FaultEvent | None:
        for pattern, fault_id in _CUDA:
            if pattern.search(text):
                return FaultEvent(self.tx.faults[fault_id], detail=_tail(text))
        return None

    def _cuda_or_host(self, line: str) -> FaultEvent | None:
        return self._cuda(line) or self._host_memory(line)

    def _gsp(self, line: str) -> FaultEvent | None:
        if _GSP_TIMEOUT.search(line):
            return FaultEvent(self.tx.faults["gsp-rpc-timeout"], detail=_tail(line))
        return None

    def _nvlink(self, line: str) -> FaultEvent | None:
        if _NVLINK_FAIL.search(line):
            return FaultEvent(self.tx.faults["nvlink-link-failure"], detail=_tail(line))
        return None

    def _aer(self, line: str) -> FaultEvent | None:
        m = _AER.search(line)
        if m is None:
            return None
        sev = m.group("sev")
        if sev == "Corrected":
            fid = "pcie-aer-corrected"
        else:
            fid = "pcie-aer-fatal" if "(Fatal)" in sev else "pcie-aer-nonfatal"
        bus = _AER_FROM.search(line) or _DEV_PREFIX.search(line)
        return FaultEvent(self.tx.faults[fid], pci_bus_id=bus.group("bus") if bus else None, detail=sev)

    def _host_memory(self, line: str) -> FaultEvent | None:
        for pattern, fault_id in _HOST_MEMORY:
            if pattern.search(line):
                return FaultEvent(self.tx.faults[fault_id], detail=_tail(line))
        return None

    def _disk_full(self, line: str) -> FaultEvent | None:
        return FaultEvent(self.tx.faults["disk-full"], detail=_tail(line))

    def _nic(self, line: str) -> FaultEvent | None:
        if _NIC_DOWN.search(line):
            return FaultEvent(self.tx.faults["nic-down"], detail=_tail(line))
        return None

    def _nan_loss(self, line: str) -> FaultEvent | None:
        if _NAN_LOSS.search(line):
            return FaultEvent(self.tx.faults["nan-loss"], detail=_tail(line))
        return None


def _tail(text: str) -> str:
    return text.strip()[-200:]


_default: LogParser | None = None


def parse_line(line: str) -> list[FaultEvent]:
    """Every fault in `line`, classified with the shipped taxonomy."""
    global _default  # noqa: PLW0603 - one parser per process, built on first use
    if _default is None:
        _default = LogParser()
    return _default.parse_line(line)
