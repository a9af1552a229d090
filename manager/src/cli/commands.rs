//! What each `zebu` command does, over the typed [`Client`] of the REST API.

use std::time::Duration;

use anyhow::bail;
use serde_json::{Value, json};
use zebu_types::requests::{AttachVolume, CreateSnapshot, CreateVolume, ExpandVolume};
use zebu_types::resources::{RebuildProgress, Volume, VolumeState};

use super::args::{NodeCmd, Output, SnapshotCmd, VolumeCmd};
use super::render::{self, emit};
use crate::client::Client;
use crate::progress::RebuildView;

pub async fn node(client: &Client, out: Output, cmd: NodeCmd) -> anyhow::Result<()> {
    match cmd {
        NodeCmd::Ls => render::list(out, &client.list_nodes().await?, render::node_table),
        NodeCmd::Stop { node } => render::value(out, &client.standalone_node(&node, "stop").await?),
        NodeCmd::Start { node } => {
            render::value(out, &client.standalone_node(&node, "start").await?)
        }
    }
}

pub async fn snapshot(client: &Client, out: Output, cmd: SnapshotCmd) -> anyhow::Result<()> {
    // Every snapshot call answers with the volume's snapshots now.
    let items = match &cmd {
        SnapshotCmd::Create { volume, name } => {
            let req = CreateSnapshot { name: name.clone() };
            client.create_snapshot(volume, &req).await?
        }
        SnapshotCmd::Ls { volume } => client.list_snapshots(volume).await?,
        SnapshotCmd::Rm { volume, name } => client.delete_snapshot(volume, name).await?,
        SnapshotCmd::Revert { volume, name } => client.revert_snapshot(volume, name).await?,
    };
    render::list(out, &items, render::snapshot_table)
}

pub async fn volume(client: &Client, out: Output, cmd: VolumeCmd) -> anyhow::Result<()> {
    match cmd {
        VolumeCmd::Create {
            name,
            size,
            replicas,
            frontend,
            from_backup: Some(backup),
            standby_from: _,
        } => {
            let req = zebu_types::requests::backup::RestoreBackup {
                volume: name,
                size: size.map(Into::into),
                number_of_replicas: replicas,
                frontend: frontend.map(Into::into),
            };
            render::one(
                out,
                &super::backup::restore(client, &backup, &req).await?,
                render::volume_table,
            )
        }
        VolumeCmd::Create {
            name,
            size: Some(size),
            replicas,
            frontend,
            from_backup: None,
            standby_from: None,
        } => {
            let mut req = CreateVolume::new(name, size);
            req.number_of_replicas = replicas;
            req.frontend = frontend.map(Into::into);
            render::one(
                out,
                &client.create_volume(&req).await?,
                render::volume_table,
            )
        }
        VolumeCmd::Create {
            name,
            size,
            replicas,
            frontend,
            from_backup: None,
            standby_from: Some(source),
        } => {
            let req = zebu_types::requests::standby::CreateStandby {
                volume: name,
                source,
                size: size.map(Into::into),
                number_of_replicas: replicas,
                frontend: frontend.map(Into::into),
            };
            render::one(
                out,
                &super::standby::create(client, &req).await?,
                render::volume_table,
            )
        }
        VolumeCmd::Activate {
            name,
            no_wait,
            timeout,
        } => super::standby::activate(client, out, &name, !no_wait, timeout).await,
        VolumeCmd::Create { size: None, .. } => bail!("--size is required"),
        VolumeCmd::Ls => render::list(out, &client.list_volumes().await?, render::volume_table),
        VolumeCmd::Get { name, watch: false } => {
            render::one(out, &client.get_volume(&name).await?, render::volume_table)
        }
        VolumeCmd::Get { name, watch: true } => watch(client, out, &name).await,
        VolumeCmd::Attach {
            name,
            node,
            maintenance,
            no_wait,
            timeout,
        } => {
            let req = AttachVolume {
                node,
                maintenance,
                frontend: None,
            };
            let v = client.attach_volume(&name, &req).await?;
            if no_wait {
                return render::one(out, &v, render::volume_table);
            }
            let v = wait_attached(client, &name, Duration::from_secs(timeout)).await?;
            match out {
                // Just the endpoint, so `dev=$(zebu volume attach v)` works.
                Output::Table => {
                    let endpoint = v.status.endpoint.as_deref().unwrap_or("");
                    emit(&format!("{endpoint}\n"))
                }
                _ => render::value(out, &v),
            }
        }
        VolumeCmd::Detach { name } => render::one(
            out,
            &client.detach_volume(&name).await?,
            render::volume_table,
        ),
        VolumeCmd::Expand { name, size } => {
            let req = ExpandVolume { size: size.into() };
            render::one(
                out,
                &client.expand_volume(&name, &req).await?,
                render::volume_table,
            )
        }
        VolumeCmd::Scrub {
            name,
            wait,
            stop,
            rate,
            timeout,
        } => {
            let how = super::scrub::How {
                wait,
                stop,
                rate,
                timeout: Duration::from_secs(timeout),
            };
            super::scrub::scrub(client, out, &name, how).await
        }
        VolumeCmd::Delete { name } => {
            let d = client.delete_volume(&name).await?;
            match out {
                Output::Table => emit(&format!("volume {name} deleted\n")),
                _ => render::value(out, &d),
            }
        }
    }
}

/// `volume get --watch`: the table once per change of what it shows, and a rebuild's
/// progress as a bar or a line of its own; with `-o json|yaml`, every object.
async fn watch(client: &Client, out: Output, name: &str) -> anyhow::Result<()> {
    let mut failure: Option<anyhow::Error> = None;
    let mut view = RebuildView::new(std::io::IsTerminal::is_terminal(&std::io::stdout()));
    let mut last_shown = Value::Null;
    client
        .watch_volume(name, |ev| {
            if ev["type"] == "Error" {
                let msg = ev["error"].as_str().unwrap_or("watch failed").to_string();
                failure = Some(anyhow::anyhow!(msg));
                return false;
            }
            let obj = &ev["object"];
            let shown = if out == Output::Table {
                let table_part = json!([
                    obj["spec"],
                    obj["status"]["state"],
                    obj["status"]["robustness"],
                    obj["status"]["replicas"]
                ]);
                let mut r = Ok(());
                if table_part != last_shown {
                    r = serde_json::from_value::<Volume>(obj.clone())
                        .map_err(anyhow::Error::from)
                        .and_then(|v| render::one(out, &v, render::volume_table));
                    last_shown = table_part;
                }
                let rebuild: Option<RebuildProgress> =
                    serde_json::from_value(obj["status"]["rebuild"].clone()).ok();
                r.and_then(|()| emit(&view.update(rebuild.as_ref())))
            } else {
                render::value(out, obj)
            };
            if let Err(e) = shown {
                failure = Some(e);
                return false;
            }
            ev["type"] != "Deleted"
        })
        .await?;
    match failure {
        Some(f) => Err(f),
        None => Ok(()),
    }
}

/// Poll the volume until it is attached (with an endpoint, unless it is attached without a
/// frontend).
pub async fn wait_attached(
    client: &Client,
    name: &str,
    timeout: Duration,
) -> anyhow::Result<Volume> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = client.get_volume(name).await?;
        let served = v.status.endpoint.is_some() || v.spec.disable_frontend;
        if v.status.state == VolumeState::Attached && served {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!(
                "volume {name} not attached after {} s (state {}, robustness {})",
                timeout.as_secs(),
                v.status.state.as_str(),
                v.status.robustness.as_str()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
