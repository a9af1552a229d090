//! The `zebu` command line's arguments (clap). Values are checked here as far as they can
//! be without the cluster (sizes, counts, timeouts within range), so a typo is exit code 2
//! before any request.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};
use zebu_types::resources::Frontend;
use zebu_types::size::ByteSize;

/// The longest wait a command accepts, in seconds (a week).
pub const MAX_WAIT_SECS: u64 = 7 * 24 * 3600;

#[derive(Debug, Parser)]
#[command(name = "zebu", about = "Zebu replicated block storage", version)]
pub struct Cli {
    /// The manager's API address, http://HOST:PORT.
    #[arg(
        long,
        global = true,
        env = "ZEBU_API",
        default_value = "http://127.0.0.1:9500"
    )]
    pub api: String,
    /// Talk to a Kubernetes cluster instead of a manager's API: the operations run in
    /// this process over the cluster's zebu.io resources.
    #[arg(long, global = true, env = "ZEBU_KUBECONFIG", value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// The namespace of the zebu.io resources, with `--kubeconfig`.
    #[arg(long, global = true, default_value = zebu_types::DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Table)]
    pub output: Output,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Table,
    Json,
    Yaml,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the manager API and N node agents on this host, in the foreground.
    Up(UpArgs),
    /// Run one node's manager in a Kubernetes cluster (its Leases, the controllers, the
    /// node agent and the REST API), in the foreground; `--kubeconfig FILE`, or in a pod
    /// the service account's in-cluster config.
    Manager(ManagerArgs),
    /// Nodes.
    #[command(subcommand)]
    Node(NodeCmd),
    /// Volumes.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Snapshots of a volume.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Backups of volumes to the backup target.
    #[command(subcommand)]
    Backup(super::backup::BackupCmd),
    /// Schedules of snapshots or backups that keep the newest `--retain`.
    #[command(subcommand, name = "recurring-job")]
    RecurringJob(super::recurring::RecurringCmd),
}

#[derive(Debug, Clone, clap::Args)]
pub struct UpArgs {
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u8).range(1..=200))]
    pub nodes: u8,
    #[arg(long, default_value = "./zebu-data")]
    pub data_dir: PathBuf,
    /// Where the API listens (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:9500")]
    pub listen: SocketAddr,
    /// The address of node-1; node-N gets the N-1th address after it. Give each cluster on
    /// one host its own range (e.g. 127.0.0.21 for a second one).
    #[arg(long, default_value = "127.0.0.11", value_name = "IP")]
    pub first_node_address: Ipv4Addr,
    /// Set a cluster setting at start, e.g. `storage-minimal-available-percentage=10`
    /// (repeatable).
    #[arg(long = "setting", value_name = "NAME=VALUE")]
    pub settings: Vec<String>,
    /// Also create this volume (if it does not exist yet) with up to 3 replicas, attach it
    /// over NBD on node-1 and print its endpoint.
    #[arg(long, value_name = "NAME")]
    pub volume: Option<String>,
    /// The size `--volume` is created with.
    #[arg(long, default_value = "10G", value_name = "SIZE")]
    pub volume_size: ByteSize,
    /// Have the `zebu-instance-manager` serving this socket start the engine and replica
    /// processes, instead of starting them as children of `zebu up`.
    #[arg(long, value_name = "SOCKET")]
    pub instance_manager: Option<PathBuf>,
    /// TLS on every replica port: a CA made at the first start (kept in
    /// `<data-dir>/tls/ca/`) signs each node's certificate for its address; engines and the
    /// manager's replica clients connect over TLS and check it.
    #[arg(long)]
    pub replica_tls: bool,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ManagerArgs {
    /// This node's name (in a pod: the Kubernetes node's). Its Lease is `zebu-node-NAME`.
    #[arg(long, value_name = "NAME", value_parser = node_name)]
    pub node: String,
    /// This node's address: its replicas and engines listen there, and the other nodes
    /// reach them there.
    #[arg(long, value_name = "IP")]
    pub address: IpAddr,
    /// Where this node's replicas keep their data and its processes their logs.
    #[arg(long, value_name = "DIR")]
    pub data_dir: PathBuf,
    /// Where the REST API listens (default: the node's address, port 9500; port 0 picks a
    /// free one).
    #[arg(long, value_name = "IP:PORT")]
    pub listen: Option<SocketAddr>,
    /// Have the `zebu-instance-manager` serving this socket start the engine and replica
    /// processes (the chart's layout), instead of starting them as this process's children.
    #[arg(long, value_name = "SOCKET")]
    pub instance_manager: Option<PathBuf>,
    /// TLS on this node's replica ports: DIR holds the cluster's replica CA (`tls.crt` and
    /// `tls.key`, a mounted Secret of type kubernetes.io/tls, or `ca.crt` and `ca.key`); the
    /// manager signs this node's certificate for `--address` with it at start. Every node of
    /// a cluster needs the same CA.
    #[arg(long, value_name = "DIR")]
    pub replica_tls_ca: Option<PathBuf>,
}

/// The longest node name whose Lease name (`zebu-node-NAME`) is still a valid object name.
const MAX_NODE_NAME: usize = 253 - "zebu-node-".len();

/// A node name: a DNS-1123 subdomain (what Kubernetes names nodes with) short enough to
/// name its Lease.
fn node_name(s: &str) -> Result<String, String> {
    zebu_types::meta::validate_object_name(s).map_err(|e| e.to_string())?;
    if s.len() > MAX_NODE_NAME {
        return Err(format!(
            "node name {s:?} is longer than {MAX_NODE_NAME} characters"
        ));
    }
    Ok(s.to_string())
}

#[derive(Debug, Subcommand)]
pub enum NodeCmd {
    /// List nodes.
    Ls,
    /// Stop a node's agent and its processes (`zebu up` only; for tests).
    #[command(hide = true)]
    Stop { node: String },
    /// Start a node's agent again (`zebu up` only; for tests).
    #[command(hide = true)]
    Start { node: String },
}

#[derive(Debug, Subcommand)]
pub enum VolumeCmd {
    /// Create a volume.
    Create {
        name: String,
        /// Size: 10G, 512M, 1Ti or bytes (with --from-backup or --standby-from: the
        /// backup's by default).
        #[arg(long, required_unless_present_any = ["from_backup", "standby_from"])]
        size: Option<ByteSize>,
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=20))]
        replicas: Option<u32>,
        #[arg(long, value_enum)]
        frontend: Option<FrontendArg>,
        /// Fill the new volume with this backup's data (it can be attached once restored).
        #[arg(long, value_name = "BACKUP", conflicts_with = "standby_from")]
        from_backup: Option<String>,
        /// A standby (disaster-recovery) volume: it follows this volume's backups in the
        /// target, each new one applied as an increment, and cannot be attached until
        /// `zebu volume activate`.
        #[arg(long, value_name = "VOLUME")]
        standby_from: Option<String>,
    },
    /// Activate a standby volume: apply the newest backup not yet applied, end standby
    /// mode; then it can be attached.
    Activate {
        name: String,
        /// Return once asked, without waiting for the activation.
        #[arg(long)]
        no_wait: bool,
        /// Seconds to wait for the activation.
        #[arg(long, default_value_t = 600, value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_SECS))]
        timeout: u64,
    },
    /// List volumes.
    Ls,
    /// Show one volume.
    Get {
        name: String,
        /// Keep printing it as it changes.
        #[arg(long)]
        watch: bool,
    },
    /// Attach a volume to a node and print its endpoint once it is served.
    Attach {
        name: String,
        #[arg(long)]
        node: Option<String>,
        /// Start its engine without a frontend: no client can use it, but snapshot revert
        /// and expansion can.
        #[arg(long)]
        maintenance: bool,
        /// Return at once instead of waiting for the endpoint.
        #[arg(long)]
        no_wait: bool,
        /// Seconds to wait for the endpoint.
        #[arg(long, default_value_t = 120, value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_SECS))]
        timeout: u64,
    },
    /// Detach a volume.
    Detach { name: String },
    /// Grow an attached volume.
    Expand {
        name: String,
        /// The new size: 20G, 1Ti or bytes.
        #[arg(long)]
        size: ByteSize,
    },
    /// Delete a volume.
    Delete { name: String },
    /// Scrub an attached volume: check every allocated block of every replica against its
    /// checksum, compare the replicas, repair what is damaged. Shows the scrub's progress, or
    /// with `--wait` follows it to its end.
    Scrub {
        name: String,
        /// Follow the scrub until it ends, then print its findings (exit code 1 if it
        /// failed or left blocks it could not repair).
        #[arg(long, conflicts_with = "stop")]
        wait: bool,
        /// Stop the running scrub instead.
        #[arg(long)]
        stop: bool,
        /// Data read per second over every replica, e.g. 32M (default: the engine's, 64M).
        #[arg(long, conflicts_with = "stop")]
        rate: Option<ByteSize>,
        /// Seconds `--wait` waits.
        #[arg(long, default_value_t = 24 * 3600, value_parser = clap::value_parser!(u64).range(1..=MAX_WAIT_SECS))]
        timeout: u64,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum FrontendArg {
    Iscsi,
    Nbd,
}

impl From<FrontendArg> for Frontend {
    fn from(f: FrontendArg) -> Self {
        match f {
            FrontendArg::Iscsi => Frontend::Iscsi,
            FrontendArg::Nbd => Frontend::Nbd,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum SnapshotCmd {
    /// Take a snapshot.
    Create {
        volume: String,
        name: Option<String>,
    },
    /// List snapshots.
    Ls { volume: String },
    /// Remove a snapshot.
    Rm { volume: String, name: String },
    /// Make a snapshot the volume's data again. The volume must be detached (it is attached
    /// without a frontend for the revert, then detached again) or attached with
    /// `--maintenance`: no client may be using it.
    Revert { volume: String, name: String },
}

/// Parse arguments; on error print one line and return the exit code.
pub fn parse_args() -> Result<Cli, u8> {
    parse_from(std::env::args_os())
}

/// [`parse_args`] over given arguments.
pub fn parse_from<I, T>(args: I) -> Result<Cli, u8>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use std::io::Write;
    match Cli::try_parse_from(args) {
        Ok(cli) => Ok(cli),
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) {
                let _ = e.print();
                return Err(
                    if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                        2
                    } else {
                        0
                    },
                );
            }
            let _ = writeln!(std::io::stderr(), "zebu: {}", one_line(&e.to_string()));
            Err(2)
        }
    }
}

/// clap's first paragraph on one line: "the following required arguments were not
/// provided:" is useless without the next line.
fn one_line(text: &str) -> String {
    let para: Vec<&str> = text
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let joined = para.join(" ");
    let line = if joined.is_empty() {
        "invalid arguments"
    } else {
        joined.as_str()
    };
    line.trim_start_matches("error: ").to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn waits_and_sizes_out_of_range_are_argument_errors() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(args)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let e = parse(&[
            "zebu",
            "volume",
            "attach",
            "v",
            "--timeout",
            "18446744073709551615",
        ])
        .expect_err("huge timeout");
        assert!(e.contains("18446744073709551615"), "{e}");
        let e = parse(&["zebu", "volume", "create", "v", "--size", "99999999999T"])
            .expect_err("huge size");
        assert!(e.contains("size \"99999999999T\" is too large"), "{e}");
        assert!(parse(&["zebu", "up", "--first-node-address", "127.0.0.300"]).is_err());
        assert!(parse(&["zebu", "snapshot", "revert", "v", "s1"]).is_ok());
        assert!(parse(&["zebu", "volume", "expand", "v", "--size", "2G"]).is_ok());
    }

    #[test]
    fn manager_flags_are_checked_before_anything_starts() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(args)
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let good = [
            "zebu",
            "manager",
            "--node",
            "worker-1.example",
            "--address",
            "127.0.0.11",
            "--data-dir",
            "/tmp/x",
        ];
        assert!(parse(&good).is_ok());
        let e = parse(&[
            "zebu",
            "manager",
            "--node",
            "Worker_1",
            "--address",
            "127.0.0.11",
            "--data-dir",
            "d",
        ])
        .expect_err("bad node name");
        assert!(e.contains("\"Worker_1\" is not valid"), "{e}");
        let e = parse(&[
            "zebu",
            "manager",
            "--node",
            "n1",
            "--address",
            "127.0.0.300",
            "--data-dir",
            "d",
        ])
        .expect_err("bad address");
        assert!(e.contains("127.0.0.300"), "{e}");
        let e =
            parse(&["zebu", "manager", "--node", "n1", "--data-dir", "d"]).expect_err("no address");
        assert!(e.contains("--address"), "{e}");
        let long = "n".repeat(250);
        let e = parse(&[
            "zebu",
            "manager",
            "--node",
            &long,
            "--address",
            "127.0.0.11",
            "--data-dir",
            "d",
        ])
        .expect_err("too long for its Lease");
        assert!(e.contains("longer than 243"), "{e}");
    }
}
