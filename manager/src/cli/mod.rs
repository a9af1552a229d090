//! The `zebu` command line: `zebu up` runs a one-host cluster in the foreground; every other
//! command is a call to a running manager's REST API through the typed [`Client`].
//!
//! - [`args`]: the arguments (clap), checked as far as they can be without the cluster;
//! - [`commands`]: what each command does;
//! - [`render`]: tables, JSON and YAML;
//! - [`up`]: `zebu up`;
//! - [`scrub`]: `zebu volume scrub`;
//! - [`backup`]: `zebu backup ...` and `zebu volume create --from-backup`.
//! - [`recurring`]: `zebu recurring-job ...`.
//! - [`kube`]: `--kubeconfig FILE`: the operations in-process over a cluster's resources.
//! - [`manager`]: `zebu manager`: one node's manager in a Kubernetes cluster.
//!
//! Bad input gets one line on stderr and exit code 2 (argument errors) or 1 (the API refused
//! or could not be reached); `-o json|yaml` prints the objects exactly as the API returns
//! them, `-o table` a summary.
//!
//! [`Client`]: crate::client::Client

pub mod args;
pub mod backup;
pub mod commands;
pub mod kube;
pub mod manager;
pub mod recurring;
pub mod render;
pub mod scrub;
pub mod standby;
pub mod up;

pub use args::{Cli, Command, parse_args};
pub use render::is_broken_pipe;

use crate::client::Client;

pub async fn run(cli: Cli) -> anyhow::Result<()> {
    let out = cli.output;
    // `zebu manager` is a long-running member of the cluster; the other commands with
    // `--kubeconfig` are one-shot calls of the operations over it.
    if let Some(kubeconfig) = &cli.kubeconfig
        && !matches!(cli.command, Command::Manager(_))
    {
        return kube::run(kubeconfig, &cli.namespace, out, cli.command).await;
    }
    // `zebu up` serves the API; every other command needs a valid address of one.
    let client = || Client::new(&cli.api);
    match cli.command {
        Command::Up(args) => up::up(args).await,
        Command::Manager(args) => {
            manager::manager(args, cli.kubeconfig.as_deref(), &cli.namespace).await
        }
        Command::Node(cmd) => commands::node(&client()?, out, cmd).await,
        Command::Volume(cmd) => commands::volume(&client()?, out, cmd).await,
        Command::Snapshot(cmd) => commands::snapshot(&client()?, out, cmd).await,
        Command::Backup(cmd) => backup::backup(&client()?, out, cmd).await,
        Command::RecurringJob(cmd) => recurring::recurring(&client()?, out, cmd).await,
    }
}
