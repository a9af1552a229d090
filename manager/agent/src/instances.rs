//! The node agent's half of the data plane: make the Replica and Engine
//! objects placed on this node true as processes, and report them.
//!
//! One pass ([`Instances::reconcile`]) looks at every Replica, then every
//! Engine whose `spec.node` is this node:
//!
//! ```text
//!  Replica/Engine           process found?        action
//!  ───────────────────────  ────────────────────  ──────────────────────────────
//!  deletionTimestamp set    yes                   SIGTERM (then SIGKILL), then ↓
//!                           no                    replica: remove its directory;
//!                                                 drop our finalizer (object goes)
//!  wanted                   yes                   adopt: status Running, pid,
//!                                                 address; engine: poll Info
//!                           no                    status Starting (written first),
//!                                                 start, status Running or Error
//! ```
//!
//! **Starts run on their own.** Starting a process waits for its ready line,
//! which for an engine can take as long as its replicas take to answer (up
//! to a minute). So each start is a task of its own: the pass writes
//! `Starting` to the store (the decision is recorded before anyone acts on
//! it), spawns the task and moves on to the node's other objects; the task
//! writes `Running` or `Error` when the process is ready or has failed. An
//! object with a start in flight is left alone by later passes, except that
//! a delete aborts the start first (a process the task already spawned is
//! then found by its command line and stopped like any other).
//!
//! **So do teardowns.** Stopping a deleted replica or engine (up to the
//! grace period) and removing a replica's directory (seconds for a large
//! one) happen in a task of their own, which drops the finalizer last; a new
//! volume's replicas and engine, later in the same pass, do not wait behind
//! an old volume's teardown. A teardown that fails leaves the finalizer, and
//! a later pass starts another.
//!
//! Processes are found by command line ([`crate::process::find`]), so after a
//! crash or restart of the manager the ones still running are adopted, and a
//! process started just before a crash is never started a second time. A
//! replica is restarted on the same directory and, when it can be, the same
//! address, so the engine sees a former member come back and catches it up.
//!
//! Finally, replica directories under `<disk>/replicas/` that no Replica
//! object names are removed: a directory is only ever created by starting a
//! Replica's process, so one without an object is left over from a delete
//! that was interrupted.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::Mutex as SyncMutex;
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use zebu_controllers::engine_status;
use zebu_ops::engine_rpc;
use zebu_types::Store;
use zebu_types::names::{ENGINE_FINALIZER, REPLICA_FINALIZER, REPLICAS_DIR};
use zebu_types::resources::{
    Engine, EngineState, Frontend, Node, Replica, ReplicaState, Resource, Volume,
};
use zebu_types::secrets::VolumeIdentity;
use zebu_types::store::{StoreError, TypedStore};

use crate::process::{self, Identity, Launch};
use crate::tls::ReplicaTls;

const REPLICA_READY_TIMEOUT: Duration = Duration::from_secs(30);
const ENGINE_READY_TIMEOUT: Duration = Duration::from_secs(60);
const RETRY_AFTER_FAILURE: Duration = Duration::from_secs(2);
/// The keys of teardown tasks among the start tasks.
const TEARDOWN: &str = "replica teardown";
const ENGINE_TEARDOWN: &str = "engine teardown";

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("node {node}: store: {source}")]
    Store {
        node: String,
        #[source]
        source: StoreError,
    },
    #[error("node {node}: removing {path}: {source}")]
    Remove {
        node: String,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// A start in flight, by the kind and name of its object.
type StartKey = (&'static str, String);

/// Runs the processes of one node. Cloning is cheap and shares everything
/// (a start task holds a clone).
pub struct Instances {
    store: Arc<dyn Store>,
    node: String,
    address: String,
    log_dir: PathBuf,
    grace: Duration,
    /// Object name -> earliest next start attempt, after a failed start.
    backoff: Arc<Mutex<HashMap<String, Instant>>>,
    /// Starts in flight. Only the agent's pass adds or removes entries; a
    /// finished task is removed on the next pass.
    starts: Arc<SyncMutex<HashMap<StartKey, JoinHandle<()>>>>,
    /// The instance manager's socket, when it starts the processes (see
    /// [`crate::instance_manager`]); `None`: this process does.
    via: Option<PathBuf>,
    /// TLS on the replica ports ([`crate::tls`]): every replica serves this node's
    /// certificate, every engine trusts the cluster's CA. `None`: plain TCP.
    tls: Option<ReplicaTls>,
}

impl Clone for Instances {
    fn clone(&self) -> Self {
        Instances {
            store: self.store.clone(),
            node: self.node.clone(),
            address: self.address.clone(),
            log_dir: self.log_dir.clone(),
            grace: self.grace,
            backoff: self.backoff.clone(),
            starts: self.starts.clone(),
            via: self.via.clone(),
            tls: self.tls.clone(),
        }
    }
}

pub fn replica_identity(r: &Replica) -> Identity {
    Identity {
        binary: "zebu-replica".into(),
        args: vec![("--dir".into(), r.spec.data_path.clone())],
        prefixed: vec![],
        // `--dir` is an absolute path in this cluster's data directory.
        stdout: None,
    }
}

/// Where an engine's stdout goes, in the node's log directory.
pub fn engine_stdout(e: &Engine, log_dir: &Path) -> PathBuf {
    log_dir.join(format!("engine-{}.out", e.metadata.name))
}

pub fn engine_identity(e: &Engine, node_address: &str, log_dir: &Path) -> Identity {
    Identity {
        binary: "zebu-engine".into(),
        args: vec![("--volume".into(), e.spec.volume.clone())],
        prefixed: vec![("--control".into(), format!("{node_address}:"))],
        stdout: Some(engine_stdout(e, log_dir)),
    }
}

/// The `host:port` of an `nbd://host:port/name` or `iscsi://host:port/...`.
fn endpoint_hostport(endpoint: &str) -> Option<&str> {
    endpoint.split_once("://")?.1.split('/').next()
}

impl Instances {
    pub fn new(store: Arc<dyn Store>, node: String, address: String, log_dir: PathBuf) -> Self {
        Instances {
            store,
            node,
            address,
            log_dir,
            grace: Duration::from_secs(10),
            backoff: Arc::new(Mutex::new(HashMap::new())),
            starts: Arc::new(SyncMutex::new(HashMap::new())),
            via: None,
            tls: None,
        }
    }

    /// Start replicas with TLS on their ports and engines trusting their CA.
    pub fn with_replica_tls(mut self, tls: Option<ReplicaTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Have the instance manager at `socket` start the processes.
    pub fn with_instance_manager(mut self, socket: Option<PathBuf>) -> Self {
        self.via = socket;
        self
    }

    fn lock_starts(&self) -> std::sync::MutexGuard<'_, HashMap<StartKey, JoinHandle<()>>> {
        // A panic while holding this lock leaves the map itself intact.
        self.starts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a start of this object is still in flight (forgetting those
    /// that have finished).
    fn start_in_flight(&self, kind: &'static str, name: &str) -> bool {
        let mut starts = self.lock_starts();
        let key = (kind, name.to_string());
        match starts.get(&key) {
            Some(task) if !task.is_finished() => true,
            Some(_) => {
                starts.remove(&key);
                false
            }
            None => false,
        }
    }

    /// Abort a start in flight and wait until its task is gone, so it can
    /// spawn nothing more; a process it already spawned is still running
    /// and is found by its command line.
    async fn abort_start(&self, kind: &'static str, name: &str) {
        let task = self.lock_starts().remove(&(kind, name.to_string()));
        if let Some(task) = task {
            task.abort();
            let _ = task.await;
            tracing::info!(node = %self.node, kind, name, "start aborted");
        }
    }

    /// Run `start` as a task of its own; see the module docs.
    fn spawn_start<F>(&self, kind: &'static str, name: &str, start: F)
    where
        F: Future<Output = Result<(), InstanceError>> + Send + 'static,
    {
        let what = format!("{kind} {name}");
        let task = tokio::spawn(async move {
            tracing::debug!("{what}: start task running");
            if let Err(e) = start.await {
                tracing::warn!("{what}: {e}");
            }
        });
        self.lock_starts().insert((kind, name.to_string()), task);
    }

    fn err(&self, source: StoreError) -> InstanceError {
        InstanceError::Store {
            node: self.node.clone(),
            source,
        }
    }

    /// Read-modify-write of an object's status, retried on conflicts.
    /// `None` when the object is gone.
    async fn write_status<R: Resource>(
        &self,
        name: &str,
        edit: impl Fn(&mut R),
    ) -> Result<Option<R>, InstanceError> {
        for _ in 0..20 {
            let Some(mut obj) = self
                .store
                .get_as::<R>(name)
                .await
                .map_err(|e| self.err(e))?
            else {
                return Ok(None);
            };
            let before = serde_json::to_value(&obj).ok();
            edit(&mut obj);
            if serde_json::to_value(&obj).ok() == before {
                return Ok(Some(obj)); // unchanged: no write, no watch event
            }
            match self.store.update_status_as(&obj).await {
                Ok(o) => return Ok(Some(o)),
                Err(StoreError::Conflict { .. }) => continue,
                Err(StoreError::NotFound { .. }) => return Ok(None),
                Err(e) => return Err(self.err(e)),
            }
        }
        tracing::warn!(node = %self.node, kind = %R::KIND, name, "status lost to repeated conflicts");
        Ok(None)
    }

    /// Remove `finalizer`, retried on conflicts; the store then deletes it.
    async fn drop_finalizer<R: Resource>(
        &self,
        name: &str,
        finalizer: &str,
    ) -> Result<(), InstanceError> {
        for _ in 0..20 {
            let Some(mut obj) = self
                .store
                .get_as::<R>(name)
                .await
                .map_err(|e| self.err(e))?
            else {
                return Ok(());
            };
            obj.metadata_mut().finalizers.retain(|f| f != finalizer);
            match self.store.update_as(&obj).await {
                Ok(_) | Err(StoreError::NotFound { .. }) => return Ok(()),
                Err(StoreError::Conflict { .. }) => continue,
                Err(e) => return Err(self.err(e)),
            }
        }
        Ok(())
    }

    async fn backing_off(&self, name: &str) -> bool {
        let b = self.backoff.lock().await;
        b.get(name).is_some_and(|t| Instant::now() < *t)
    }

    async fn failed(&self, name: &str) {
        self.backoff
            .lock()
            .await
            .insert(name.to_string(), Instant::now() + RETRY_AFTER_FAILURE);
    }

    /// One pass over this node's replicas and engines.
    pub async fn reconcile(&self) -> Result<(), InstanceError> {
        let replicas: Vec<Replica> = self.store.list_as().await.map_err(|e| self.err(e))?;
        for r in replicas.iter().filter(|r| r.spec.node == self.node) {
            if let Err(e) = self.reconcile_replica(r).await {
                tracing::warn!(replica = %r.metadata.name, "{e}");
            }
        }
        let engines: Vec<Engine> = self.store.list_as().await.map_err(|e| self.err(e))?;
        for e in engines.iter().filter(|e| e.spec.node == self.node) {
            if let Err(err) = self.reconcile_engine(e).await {
                tracing::warn!(engine = %e.metadata.name, "{err}");
            }
        }
        self.remove_orphan_dirs().await
    }

    async fn reconcile_replica(&self, r: &Replica) -> Result<(), InstanceError> {
        let name = &r.metadata.name;
        let id = replica_identity(r);
        if r.metadata.deletion_timestamp.is_some() {
            self.abort_start("replica", name).await;
        } else if self.start_in_flight("replica", name) {
            return Ok(());
        }
        if r.metadata.deletion_timestamp.is_some() {
            // In a task of its own: stopping the process and removing a large directory take
            // up to seconds, and the replicas and engines after this one in the pass (a new
            // volume's, often) must not wait for them.
            if !self.start_in_flight(TEARDOWN, name) {
                let me = self.clone();
                let r = r.clone();
                self.spawn_start(TEARDOWN, name, async move { me.teardown_replica(&r).await });
            }
            return Ok(());
        }
        let running = process::find(&id, r.status.pid);
        let stdout = self.log_dir.join(format!("replica-{name}.out"));
        if let Some(pid) = running {
            // Adopt: the address is what the store says, else what it printed.
            let address = r
                .status
                .address
                .clone()
                .or_else(|| process::announced(&stdout).remove("listening"));
            self.write_status::<Replica>(name, |o| {
                o.status.state = ReplicaState::Running;
                o.status.observed_generation = o.metadata.generation;
                o.status.pid = Some(pid);
                o.status.address = address.clone();
                o.status.message.clear();
            })
            .await?;
            return Ok(());
        }
        if self.backing_off(name).await {
            return Ok(());
        }
        if r.status.state == ReplicaState::Running {
            tracing::warn!(replica = %name, pid = ?r.status.pid, "replica process is gone; restarting it");
        }
        // Same address as before when there was one, so the engine sees a
        // former member come back.
        let listen = r
            .status
            .address
            .clone()
            .unwrap_or_else(|| format!("{}:0", self.address));
        let identity = match self.volume_identity(&r.spec.volume).await {
            Ok(i) => i,
            Err(msg) => return self.replica_failed(name, &msg, false).await,
        };
        self.write_status::<Replica>(name, |o| {
            o.status.state = ReplicaState::Starting;
            o.status.pid = None;
        })
        .await?;
        let mut args: Vec<String> = vec![
            "serve".into(),
            "--dir".into(),
            r.spec.data_path.clone(),
            "--listen".into(),
            listen.clone(),
            "--size".into(),
            r.spec.size.bytes().to_string(),
        ];
        if let Some((_, secret)) = &identity {
            args.extend(["--secret-file".into(), secret.display().to_string()]);
        }
        if let Some(tls) = &self.tls {
            args.extend([
                "--tls-cert".into(),
                tls.cert.display().to_string(),
                "--tls-key".into(),
                tls.key.display().to_string(),
            ]);
        }
        let launch = match process::binary("zebu-replica") {
            Ok(binary) => Launch {
                what: format!("replica {name}"),
                binary,
                args,
                stdout,
                log: self.log_dir.join(format!("replica-{name}.log")),
                ready_prefix: "listening on ".into(),
                timeout: REPLICA_READY_TIMEOUT,
                via: self.via.clone(),
            },
            Err(e) => return self.replica_failed(name, &e.to_string(), false).await,
        };
        let me = self.clone();
        let owned = name.clone();
        self.spawn_start("replica", name, async move {
            me.launch_replica(&owned, launch).await
        });
        Ok(())
    }

    /// The teardown task of a deleted replica: stop its process, remove its directory, then
    /// let the object go. A failure leaves the finalizer; the next pass tries again.
    async fn teardown_replica(&self, r: &Replica) -> Result<(), InstanceError> {
        let name = &r.metadata.name;
        let id = replica_identity(r);
        if let Some(pid) = process::find(&id, r.status.pid) {
            process::stop(pid, &id, self.grace).await;
        }
        let dir = PathBuf::from(&r.spec.data_path);
        let removed = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || std::fs::remove_dir_all(dir))
                .await
                .unwrap_or_else(|e| Err(std::io::Error::other(e)))
        };
        match removed {
            Ok(()) => {
                tracing::info!(replica = %name, dir = %dir.display(), "replica directory removed")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(InstanceError::Remove {
                    node: self.node.clone(),
                    path: dir,
                    source,
                });
            }
        }
        let _ = std::fs::remove_file(self.log_dir.join(format!("replica-{name}.out")));
        self.drop_finalizer::<Replica>(name, REPLICA_FINALIZER)
            .await
    }

    /// The start task of a replica: launch, then record the outcome.
    async fn launch_replica(&self, name: &str, launch: Launch) -> Result<(), InstanceError> {
        match process::launch(&launch).await {
            Ok(started) => {
                let address = started.announced.get("listening").cloned();
                self.write_status::<Replica>(name, |o| {
                    o.status.state = ReplicaState::Running;
                    o.status.observed_generation = o.metadata.generation;
                    o.status.pid = Some(started.pid);
                    o.status.address = address.clone();
                    o.status.message.clear();
                })
                .await?;
                tracing::info!(replica = %name, pid = started.pid, address = ?address, "replica running");
                Ok(())
            }
            Err(e) => {
                let msg = e.to_string();
                // The old port is taken by someone else: take a new one next
                // time; the volume controller re-adds the new address.
                let forget = msg.contains("in use");
                self.replica_failed(name, &msg, forget).await
            }
        }
    }

    async fn replica_failed(
        &self,
        name: &str,
        msg: &str,
        forget_address: bool,
    ) -> Result<(), InstanceError> {
        tracing::warn!(replica = %name, "cannot start: {msg}");
        self.failed(name).await;
        self.write_status::<Replica>(name, |o| {
            o.status.state = ReplicaState::Error;
            o.status.pid = None;
            o.status.message = msg.to_string();
            if forget_address {
                o.status.address = None;
            }
        })
        .await?;
        Ok(())
    }

    async fn reconcile_engine(&self, e: &Engine) -> Result<(), InstanceError> {
        let name = &e.metadata.name;
        let id = engine_identity(e, &self.address, &self.log_dir);
        if e.metadata.deletion_timestamp.is_some() {
            self.abort_start("engine", name).await;
        } else if self.start_in_flight("engine", name) {
            return Ok(());
        }
        if e.metadata.deletion_timestamp.is_some() {
            // In a task of its own, as a replica's: an engine that ignores SIGTERM holds its
            // stop for the grace period, and the node's other objects must not wait for it.
            if !self.start_in_flight(ENGINE_TEARDOWN, name) {
                let me = self.clone();
                let e = e.clone();
                self.spawn_start(ENGINE_TEARDOWN, name, async move {
                    me.teardown_engine(&e).await
                });
            }
            return Ok(());
        }
        let running = process::find(&id, e.status.pid);
        let stdout = engine_stdout(e, &self.log_dir);
        if let Some(pid) = running {
            return self.observe_engine(e, pid, &stdout).await;
        }
        if self.backing_off(name).await {
            return Ok(());
        }
        if e.status.state == EngineState::Running {
            tracing::warn!(engine = %name, pid = ?e.status.pid, "engine process is gone; restarting it");
        }
        self.write_status::<Engine>(name, |o| {
            o.status.state = EngineState::Starting;
            o.status.pid = None;
        })
        .await?;
        let binary = match process::binary("zebu-engine") {
            Ok(b) => b,
            Err(err) => return self.engine_failed(name, &err.to_string()).await,
        };
        let identity = match self.volume_identity(&e.spec.volume).await {
            Ok(i) => i,
            Err(msg) => return self.engine_failed(name, &msg).await,
        };
        let launch = Launch {
            what: format!("engine {name}"),
            binary,
            args: engine_args(e, &self.address, identity.as_ref(), self.tls.as_ref()),
            stdout: stdout.clone(),
            log: self.log_dir.join(format!("engine-{name}.log")),
            ready_prefix: "ready".into(),
            timeout: ENGINE_READY_TIMEOUT,
            via: self.via.clone(),
        };
        let me = self.clone();
        let engine = e.clone();
        self.spawn_start("engine", name, async move {
            match process::launch(&launch).await {
                Ok(started) => {
                    tracing::info!(engine = %engine.metadata.name, pid = started.pid, "engine running");
                    me.observe_engine(&engine, started.pid, &stdout).await
                }
                Err(err) => {
                    me.engine_failed(&engine.metadata.name, &err.to_string())
                        .await
                }
            }
        });
        Ok(())
    }

    /// The teardown task of a deleted engine: stop its process, then let the object go.
    async fn teardown_engine(&self, e: &Engine) -> Result<(), InstanceError> {
        let id = engine_identity(e, &self.address, &self.log_dir);
        if let Some(pid) = process::find(&id, e.status.pid) {
            process::stop(pid, &id, self.grace).await;
        }
        self.drop_finalizer::<Engine>(&e.metadata.name, ENGINE_FINALIZER)
            .await
    }

    /// The uuid and a local secret file of `volume` (issue 18; `zebu_types::secrets`), `None`
    /// for a volume made before identities (or gone), `Err` while its secret cannot be had.
    async fn volume_identity(&self, volume: &str) -> Result<Option<(String, PathBuf)>, String> {
        let v = match self.store.get_as::<Volume>(volume).await {
            Ok(v) => v,
            Err(e) => return Err(format!("cannot read volume {volume:?}: {e}")),
        };
        let Some(id) = v.as_ref().and_then(|v| VolumeIdentity::of(&v.metadata)) else {
            return Ok(None);
        };
        let Some(keeper) = self.store.secrets() else {
            return Err(format!(
                "volume {volume:?} has a secret ({}) but this store keeps none",
                id.secret_name
            ));
        };
        match keeper.local_file(&id.secret_name).await {
            Ok(path) => Ok(Some((id.uuid, path))),
            Err(e) => Err(format!("waiting for the secret of volume {volume:?}: {e}")),
        }
    }
}

/// The command line of `e`'s engine on the node at `addr`: the volume's uuid and secret file
/// when it has them (`identity`), never the secret itself; the CA its replicas' certificates
/// are checked against when the cluster has TLS on the replica ports.
fn engine_args(
    e: &Engine,
    addr: &str,
    identity: Option<&(String, PathBuf)>,
    tls: Option<&ReplicaTls>,
) -> Vec<String> {
    // Reuse the previous ports after a restart so clients reconnect to
    // the same endpoint.
    let control = e
        .status
        .control_address
        .clone()
        .unwrap_or_else(|| format!("{addr}:0"));
    let frontend_listen = e
        .status
        .endpoint
        .as_deref()
        .and_then(endpoint_hostport)
        .map_or_else(|| format!("{addr}:0"), str::to_string);
    let mut args = vec![
        "serve".to_string(),
        "--volume".into(),
        e.spec.volume.clone(),
        "--size".into(),
        e.spec.size.bytes().to_string(),
        "--control".into(),
        control,
        "--local-host".into(),
        addr.to_string(),
    ];
    for a in e.spec.replica_addresses.values() {
        args.extend(["--replica".into(), a.clone()]);
    }
    // Without a frontend the engine serves only its control API (maintenance).
    if !e.spec.disable_frontend {
        match e.spec.frontend {
            Frontend::Nbd => {
                args.extend(["--frontend".into(), "nbd".into(), "--nbd-listen".into()])
            }
            Frontend::Iscsi => {
                args.extend(["--frontend".into(), "iscsi".into(), "--iscsi-listen".into()]);
            }
        }
        args.push(frontend_listen);
    }
    if e.spec.salvage {
        args.push("--salvage".into());
    }
    if let Some((uuid, secret)) = identity {
        args.extend([
            "--volume-uuid".into(),
            uuid.clone(),
            "--secret-file".into(),
            secret.display().to_string(),
        ]);
    }
    if let Some(tls) = tls {
        args.extend(["--tls-ca".into(), tls.ca.display().to_string()]);
    }
    args
}

impl Instances {
    async fn engine_failed(&self, name: &str, msg: &str) -> Result<(), InstanceError> {
        tracing::warn!(engine = %name, "cannot start: {msg}");
        self.failed(name).await;
        self.write_status::<Engine>(name, |o| {
            o.status.state = EngineState::Error;
            o.status.pid = None;
            o.status.message = msg.to_string();
        })
        .await?;
        Ok(())
    }

    /// Record a running engine: pid, endpoints, and what its Info says.
    async fn observe_engine(
        &self,
        e: &Engine,
        pid: u32,
        stdout: &Path,
    ) -> Result<(), InstanceError> {
        let said = process::announced(stdout);
        let control = e
            .status
            .control_address
            .clone()
            .or_else(|| said.get("control").cloned());
        let endpoint = e
            .status
            .endpoint
            .clone()
            .or_else(|| said.get("nbd").or_else(|| said.get("iscsi")).cloned());
        let info = match &control {
            Some(c) => engine_rpc::info(c).await.map_err(|err| err.to_string()),
            None => Err("the engine has not printed its control address".to_string()),
        };
        // The replicas as stored now, after the engine answered: a pid read before a
        // replica's restart (this agent restarts its own replicas earlier in the same pass)
        // would be taken for the process the engine calls RW, and stick, since the engine
        // never sees that old process fail; the volume would stay Degraded for good.
        let replicas: Vec<Replica> = self.store.list_as().await.map_err(|e| self.err(e))?;
        // Progress for `zebu volume get --watch`; an engine that cannot say
        // keeps the last answer.
        let rebuild = match (&control, &info) {
            (Some(c), Ok(_)) => match engine_rpc::rebuild_status(c).await {
                Ok(r) => engine_status::rebuild_progress(&e.spec.volume, &r, &replicas),
                Err(err) => {
                    tracing::debug!(engine = %e.metadata.name, "RebuildStatus: {err}");
                    e.status.rebuild.clone()
                }
            },
            _ => e.status.rebuild.clone(),
        };
        self.write_status::<Engine>(&e.metadata.name, |o| {
            if o.status.pid != Some(pid) {
                // Another engine process: what the old one took is moot,
                // and so are the modes it reported.
                o.status.replica_pids.clear();
                o.status.replica_modes.clear();
            }
            o.status.state = EngineState::Running;
            o.status.observed_generation = o.metadata.generation;
            o.status.pid = Some(pid);
            o.status.control_address = control.clone();
            o.status.endpoint = endpoint.clone();
            o.status.rebuild = rebuild.clone();
            match &info {
                Ok(i) => engine_status::fold_info(&mut o.status, &o.spec.volume, i, &replicas),
                Err(err) => o.status.message = err.clone(),
            }
        })
        .await?;
        Ok(())
    }

    async fn remove_orphan_dirs(&self) -> Result<(), InstanceError> {
        let Some(node) = self
            .store
            .get_as::<Node>(&self.node)
            .await
            .map_err(|e| self.err(e))?
        else {
            return Ok(());
        };
        // Directories first, objects second: a directory seen here was
        // created for an object that already existed, so it is in the list
        // unless it was deleted since.
        let mut dirs = Vec::new();
        for disk in node.spec.disks.values() {
            let Ok(rd) = std::fs::read_dir(Path::new(&disk.path).join(REPLICAS_DIR)) else {
                continue;
            };
            dirs.extend(rd.filter_map(|e| Some(e.ok()?.path())));
        }
        if dirs.is_empty() {
            return Ok(());
        }
        let replicas: Vec<Replica> = self.store.list_as().await.map_err(|e| self.err(e))?;
        for dir in dirs {
            let known = replicas
                .iter()
                .any(|r| Path::new(&r.spec.data_path) == dir.as_path());
            let path = dir.display().to_string();
            let id = Identity {
                binary: "zebu-replica".into(),
                args: vec![("--dir".into(), path.clone())],
                prefixed: vec![],
                stdout: None,
            };
            if known || process::find(&id, None).is_some() {
                continue;
            }
            tracing::warn!(node = %self.node, dir = %path, "removing a replica directory no Replica names");
            std::fs::remove_dir_all(&dir).map_err(|source| InstanceError::Remove {
                node: self.node.clone(),
                path: dir.clone(),
                source,
            })?;
        }
        Ok(())
    }

    /// Record as `Stopped` every object of this node that the store says
    /// runs but whose process is gone (the manager and its processes were
    /// killed, or the host rebooted). Run before anything reads the store
    /// after a start, so no one takes a dead engine's old endpoint for a
    /// served volume; the agent's passes then start them again.
    pub async fn mark_gone_as_stopped(&self) -> Result<(), InstanceError> {
        let replicas: Vec<Replica> = self.store.list_as().await.map_err(|e| self.err(e))?;
        for r in replicas.iter().filter(|r| r.spec.node == self.node) {
            if r.status.state == ReplicaState::Running
                && process::find(&replica_identity(r), r.status.pid).is_none()
            {
                self.write_status::<Replica>(&r.metadata.name, |o| {
                    o.status.state = ReplicaState::Stopped;
                    o.status.pid = None;
                })
                .await?;
            }
        }
        let engines: Vec<Engine> = self.store.list_as().await.map_err(|e| self.err(e))?;
        for e in engines.iter().filter(|e| e.spec.node == self.node) {
            if e.status.state == EngineState::Running
                && process::find(
                    &engine_identity(e, &self.address, &self.log_dir),
                    e.status.pid,
                )
                .is_none()
            {
                self.write_status::<Engine>(&e.metadata.name, |o| {
                    o.status.state = EngineState::Stopped;
                    o.status.pid = None;
                })
                .await?;
            }
        }
        Ok(())
    }

    /// Stop every process of this node (engines first, so they flush to
    /// their replicas) and record them as `Stopped`, keeping their
    /// addresses: the next start of the agent starts them again where they
    /// were.
    pub async fn stop_all(&self) {
        // No start may spawn anything after this point.
        let starts: Vec<JoinHandle<()>> = self.lock_starts().drain().map(|(_, t)| t).collect();
        for task in starts {
            task.abort();
            let _ = task.await;
        }
        if let Ok(engines) = self.store.list_as::<Engine>().await {
            for e in engines.iter().filter(|e| e.spec.node == self.node) {
                let id = engine_identity(e, &self.address, &self.log_dir);
                if let Some(pid) = process::find(&id, e.status.pid) {
                    process::stop(pid, &id, self.grace).await;
                }
                let stopped = self.write_status::<Engine>(&e.metadata.name, |o| {
                    o.status.state = EngineState::Stopped;
                    o.status.pid = None;
                });
                if let Err(err) = stopped.await {
                    tracing::warn!(engine = %e.metadata.name, "{err}");
                }
            }
        }
        if let Ok(replicas) = self.store.list_as::<Replica>().await {
            for r in replicas.iter().filter(|r| r.spec.node == self.node) {
                let id = replica_identity(r);
                if let Some(pid) = process::find(&id, r.status.pid) {
                    process::stop(pid, &id, self.grace).await;
                }
                let stopped = self.write_status::<Replica>(&r.metadata.name, |o| {
                    o.status.state = ReplicaState::Stopped;
                    o.status.pid = None;
                });
                if let Err(err) = stopped.await {
                    tracing::warn!(replica = %r.metadata.name, "{err}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use zebu_types::resources::EngineSpec;

    fn engine() -> Engine {
        Engine::new(
            "db-e",
            EngineSpec {
                volume: "db".into(),
                node: "node-1".into(),
                size: "64M".parse().expect("size"),
                replica_addresses: [("db-r-1".to_string(), "127.0.0.12:4000".to_string())].into(),
                frontend: Frontend::Nbd,
                disable_frontend: false,
                salvage: false,
            },
        )
    }

    #[test]
    fn an_engine_gets_its_volumes_uuid_and_secret_file_and_an_old_volume_neither() {
        let id = (
            "3f2a".to_string(),
            PathBuf::from("/d/secrets/zebu-volume-db"),
        );
        let args = engine_args(&engine(), "127.0.0.11", Some(&id), None);
        let at = |f: &str| {
            args.iter()
                .position(|a| a == f)
                .map(|i| args[i + 1].as_str())
        };
        assert_eq!(at("--volume-uuid"), Some("3f2a"));
        assert_eq!(at("--secret-file"), Some("/d/secrets/zebu-volume-db"));
        // A volume made before identities (upgrade): started as it was, no uuid, no secret.
        let old = engine_args(&engine(), "127.0.0.11", None, None);
        assert!(
            !old.iter()
                .any(|a| a == "--volume-uuid" || a == "--secret-file"),
            "{old:?}"
        );
        assert_eq!(args[..old.len()], old[..]);
    }

    #[test]
    fn with_replica_tls_an_engine_trusts_the_clusters_ca_and_without_it_connects_plainly() {
        let tls = ReplicaTls {
            ca: "/d/node-1/tls/ca.crt".into(),
            cert: "/d/node-1/tls/replica.crt".into(),
            key: "/d/node-1/tls/replica.key".into(),
        };
        let args = engine_args(&engine(), "127.0.0.11", None, Some(&tls));
        let at = args.iter().position(|a| a == "--tls-ca");
        assert_eq!(
            at.map(|i| args[i + 1].as_str()),
            Some("/d/node-1/tls/ca.crt")
        );
        let plain = engine_args(&engine(), "127.0.0.11", None, None);
        assert!(!plain.iter().any(|a| a.starts_with("--tls")), "{plain:?}");
    }
}
