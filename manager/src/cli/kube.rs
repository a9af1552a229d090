//! `zebu --kubeconfig FILE ...`: the CLI against a cluster, with the operations layer run
//! in-process over the Kubernetes store (uncached: one request per read). The same rules
//! apply as through a manager's REST API (ops is the one place they live); the managers in
//! the cluster then act on what was written, as they do for `kubectl apply`.
//!
//! Commands that must talk to an engine (snapshots, expansion) or to `zebu up`'s nodes are
//! refused with a message pointing at `--api`.

use anyhow::{Context, bail};
use zebu_ops::Ops;
use zebu_store::{StoreConfig, open};
use zebu_types::requests::{AttachVolume, CreateVolume, Items};

use super::args::{Command, NodeCmd, Output, VolumeCmd};
use super::render::{self, emit};

pub async fn run(
    kubeconfig: &std::path::Path,
    namespace: &str,
    out: Output,
    command: Command,
) -> anyhow::Result<()> {
    let config = StoreConfig::Kube {
        kubeconfig: Some(kubeconfig.to_path_buf()),
        namespace: namespace.to_string(),
        cached: false,
    };
    let store = open(&config)
        .await
        .with_context(|| format!("connecting with {}", kubeconfig.display()))?;
    let ops = Ops::new(store);
    match command {
        Command::Node(NodeCmd::Ls) => {
            let items = Items {
                items: ops.list_nodes().await?,
            };
            render::list(out, &items, render::node_table)
        }
        Command::Volume(cmd) => volume(&ops, out, cmd).await,
        Command::Up(_) => bail!("zebu up runs on one host; leave out --kubeconfig"),
        Command::Manager(_) => bail!("zebu manager is not a one-shot command"),
        Command::Node(_) | Command::Snapshot(_) | Command::Backup(_) => {
            bail!("this command is not available with --kubeconfig yet; use --api with a manager")
        }
    }
}

async fn volume(ops: &Ops, out: Output, cmd: VolumeCmd) -> anyhow::Result<()> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            replicas,
            frontend,
            from_backup,
            standby_from: Some(source),
        } => {
            if from_backup.is_some() {
                bail!("--from-backup and --standby-from cannot both be given")
            }
            let req = zebu_types::requests::standby::CreateStandby {
                volume: name,
                source,
                size: size.map(Into::into),
                number_of_replicas: replicas,
                frontend: frontend.map(Into::into),
            };
            render::one(out, &ops.create_standby(req).await?, render::volume_table)
        }
        VolumeCmd::Create {
            name,
            size,
            replicas,
            frontend,
            from_backup,
            standby_from: None,
        } => {
            if from_backup.is_some() {
                bail!(
                    "--from-backup is not available with --kubeconfig yet; use --api with a manager"
                )
            }
            let Some(size) = size else {
                bail!("--size is required")
            };
            let mut req = CreateVolume::new(name, size);
            req.number_of_replicas = replicas;
            req.frontend = frontend.map(Into::into);
            render::one(out, &ops.create_volume(req).await?, render::volume_table)
        }
        VolumeCmd::Ls => {
            let items = Items {
                items: ops.list_volumes().await?,
            };
            render::list(out, &items, render::volume_table)
        }
        VolumeCmd::Get { name, watch: false } => {
            render::one(out, &ops.get_volume(&name).await?, render::volume_table)
        }
        VolumeCmd::Attach {
            name,
            node,
            maintenance,
            ..
        } => {
            // The attached node's manager starts the engine; `kubectl get zv -w` or
            // `zebu --kubeconfig F volume get` shows when it serves.
            let req = AttachVolume {
                node,
                maintenance,
                frontend: None,
            };
            render::one(
                out,
                &ops.attach_volume(&name, req).await?,
                render::volume_table,
            )
        }
        VolumeCmd::Detach { name } => {
            render::one(out, &ops.detach_volume(&name).await?, render::volume_table)
        }
        VolumeCmd::Activate { name, .. } => {
            // The cluster's standby controller carries it out; `volume get` shows when.
            render::one(
                out,
                &ops.activate_standby(&name).await?,
                render::volume_table,
            )
        }
        VolumeCmd::Delete { name } => {
            let held = ops.delete_volume(&name).await?;
            match out {
                Output::Table => emit(&format!("volume {name} deleted\n")),
                _ => render::value(out, &held),
            }
        }
        VolumeCmd::Get { watch: true, .. } | VolumeCmd::Expand { .. } | VolumeCmd::Scrub { .. } => {
            bail!("this command is not available with --kubeconfig yet; use --api with a manager")
        }
    }
}
