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

/// The workloads named on a command line (`--workloads a,b`), in that order; all of them
/// when none is named.
pub fn select_workloads(names: &[String]) -> anyhow::Result<Vec<Workload>> {
    if names.is_empty() {
        return Ok(WORKLOADS.to_vec());
    }
    names
        .iter()
        .map(|name| {
            WORKLOADS
                .iter()
                .find(|w| w.name == name)
                .copied()
                .ok_or_else(|| anyhow::anyhow!("unknown workload {name:?}"))
        })
        .collect()
}

/// What fio measured for one row.
#[derive(Debug, Clone)]
pub struct FioResult {
    pub ops: u64,
    pub bytes: u64,
    pub elapsed: std::time::Duration,
    /// Submission plus completion latency, mean.
    pub mean_latency_us: f64,
}

/// The reference row: fio with io_uring and `O_DIRECT` on `file` (which must exist with
/// `size` bytes), the same block size, pattern and queue depth as `w`, for `runtime_s`
/// seconds; write rows end with an fsync, as the Zebu rows end with a flush.
pub fn run_fio(
    w: &Workload,
    file: &std::path::Path,
    size: u64,
    runtime_s: u64,
    iodepth: usize,
) -> anyhow::Result<FioResult> {
    use anyhow::Context;
    let out = std::process::Command::new("fio")
        .arg("--name=ref")
        .arg(format!("--filename={}", file.display()))
        .args(["--ioengine=io_uring", "--direct=1"])
        .arg(format!("--rw={}", w.fio_rw))
        .arg(format!("--bs={}", w.block))
        .arg(format!("--iodepth={iodepth}"))
        .arg("--numjobs=1")
        .arg(format!("--size={size}"))
        .arg("--time_based=1")
        .arg(format!("--runtime={runtime_s}"))
        .args(["--norandommap=1", "--randrepeat=0", "--allow_file_create=0"])
        .arg(format!("--end_fsync={}", u8::from(w.write)))
        .arg("--output-format=json")
        .output()
        .context("run fio (is it installed?)")?;
    if !out.status.success() {
        anyhow::bail!(
            "fio failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let report: serde_json::Value =
        serde_json::from_slice(&out.stdout).context("parse fio JSON output")?;
    let job = &report["jobs"][0];
    let side = if w.write { &job["write"] } else { &job["read"] };
    let runtime_ms = side["runtime"].as_u64().context("fio runtime")?;
    let mean_ns = side["clat_ns"]["mean"].as_f64().unwrap_or(0.0)
        + side["slat_ns"]["mean"].as_f64().unwrap_or(0.0);
    Ok(FioResult {
        ops: side["total_ios"].as_u64().context("fio total_ios")?,
        bytes: side["io_bytes"].as_u64().context("fio io_bytes")?,
        elapsed: std::time::Duration::from_millis(runtime_ms.max(1)),
        mean_latency_us: mean_ns / 1e3,
    })
}
