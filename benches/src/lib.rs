//! What the benchmark binaries in `src/bin/` share: the workload table they all measure,
//! so that every benchmark's rows mean the same thing as fio's.

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * KIB;
pub const GIB: u64 = 1024 * MIB;

/// One row kind of a benchmark.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub name: &'static str,
    /// fio's `--rw`.
    pub fio_rw: &'static str,
    pub block: u64,
    pub write: bool,
    pub random: bool,
}

/// 4 KiB random write and read, 1 MiB sequential write and read.
pub const WORKLOADS: [Workload; 4] = [
    Workload {
        name: "randwrite",
        fio_rw: "randwrite",
        block: 4 * KIB,
        write: true,
        random: true,
    },
    Workload {
        name: "randread",
        fio_rw: "randread",
        block: 4 * KIB,
        write: false,
        random: true,
    },
    Workload {
        name: "seqwrite",
        fio_rw: "write",
        block: MIB,
        write: true,
        random: false,
    },
    Workload {
        name: "seqread",
        fio_rw: "read",
        block: MIB,
        write: false,
        random: false,
    },
];
