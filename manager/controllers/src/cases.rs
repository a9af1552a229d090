//! The controllers' decision cases as data, so the same table runs against a world built
//! directly from objects ([`check`]) and against one loaded from any store backend after the
//! objects were written into it ([`check_on_store`]): the embedded store in this crate's
//! tests, the Kubernetes store in its own.
//!
//! Each [`Case`] is a small cluster (nodes node-1…node-4 on 127.0.0.11…14, volume `v` of
//! 1 GiB and its replicas `v-r-N`), the object to decide, and the actions expected, each as
//! its one-line `Display`. A case with [`Fixture::presence`] decides as a cluster member
//! does, with presence from node Leases; [`Target::Owner`] asks what one manager does with
//! a volume ([`crate::ownership`]).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use zebu_types::names::{SUPERSEDED_LABEL, VOLUME_FINALIZER};
use zebu_types::resources::{
    ConditionStatus, DiskSpec, DiskStatus, Engine, EngineSpec, EngineState, EngineVolumeState,
    Frontend, Node, NodeSpec, Replica, ReplicaMode, ReplicaSpec, ReplicaState, Resource, Setting,
    SettingSpec, Volume, VolumeSpec, VolumeState, condition, set_condition_at,
};
use zebu_types::size::ByteSize;
use zebu_types::store::{StoreError, TypedStore};
use zebu_types::{Store, time};

use crate::presence::{Presence, PresenceMap};
use crate::{World, WorldError, gc, node, ownership, volume};

const GIB: u64 = 1 << 30;

/// The objects of one case.
#[derive(Debug, Clone)]
pub struct Fixture {
    pub now: SystemTime,
    pub volumes: Vec<Volume>,
    pub nodes: Vec<Node>,
    pub replicas: Vec<Replica>,
    pub engines: Vec<Engine>,
    pub settings: Vec<Setting>,
    /// Presence from node Leases (a cluster); `None`: from the nodes' `Ready` conditions.
    pub presence: Option<PresenceMap>,
    /// With Leases: whether the deciding manager observed them for a whole Lease duration.
    pub leases_settled: bool,
}

/// Which object a case decides.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Volume(&'static str),
    Node(&'static str),
    Engine(&'static str),
    Replica(&'static str),
    /// What the manager of node `me` does with the volume.
    Owner {
        volume: &'static str,
        me: &'static str,
    },
}

#[derive(Debug, Clone)]
pub struct Case {
    pub name: &'static str,
    pub fixture: Fixture,
    pub target: Target,
    pub expect: Vec<String>,
}

/// The instant every case decides at.
pub fn now() -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

fn ago(secs: u64) -> String {
    time::format_rfc3339(now() - Duration::from_secs(secs))
}

/// node-`i` on 127.0.0.1`i`, Ready, one 100 GiB disk, last heartbeat 1 s ago.
pub fn ready_node(i: u32) -> Node {
    let name = format!("node-{i}");
    let mut n = Node::new(
        name.clone(),
        NodeSpec {
            address: format!("127.0.0.{}", 10 + i),
            disks: [(
                "disk-0".to_string(),
                DiskSpec {
                    path: format!("/data/{name}/disk-0"),
                    tags: vec![],
                    allow_scheduling: true,
                    storage_reserved: ByteSize(0),
                },
            )]
            .into(),
            tags: vec![],
            allow_scheduling: true,
        },
    );
    n.status.disk_status.insert(
        "disk-0".into(),
        DiskStatus {
            storage_maximum: ByteSize(100 * GIB),
            storage_available: ByteSize(100 * GIB),
            ..Default::default()
        },
    );
    for c in [condition::READY, condition::SCHEDULABLE] {
        set_condition_at(
            &mut n.status.conditions,
            c,
            ConditionStatus::True,
            "Heartbeat",
            "",
            &ago(3600),
        );
    }
    n.status.last_heartbeat = Some(ago(1));
    n
}

/// node-`i`, not Ready for `secs` seconds (heartbeats stopped before that).
pub fn down_node(i: u32, secs: u64) -> Node {
    let mut n = ready_node(i);
    for c in [condition::READY, condition::SCHEDULABLE] {
        set_condition_at(
            &mut n.status.conditions,
            c,
            ConditionStatus::False,
            "HeartbeatLost",
            "no heartbeat for 10 s",
            &ago(secs),
        );
    }
    n.status.last_heartbeat = Some(ago(secs + 10));
    n
}

/// Volume `v`: 1 GiB, `replicas` replicas, NBD, attached to `node` if given, with its
/// finalizer (as ops creates it), stale replicas replaced after 60 s.
pub fn vol(replicas: u32, node: Option<&str>) -> Volume {
    let mut v = Volume::new(
        "v",
        VolumeSpec {
            size: ByteSize(GIB),
            number_of_replicas: replicas,
            frontend: Frontend::Nbd,
            node_selector: vec![],
            disk_selector: vec![],
            data_locality: Default::default(),
            stale_replica_timeout: 60,
            node_id: node.map(str::to_string),
            disable_frontend: false,
        },
    );
    v.metadata.finalizers.push(VOLUME_FINALIZER.into());
    v
}

/// Replica `v-r-<i>` on node-`node`, in `state`; a running one listens on
/// 127.0.0.1`node`:900`i` with pid 100+`i`.
pub fn rep(i: u32, node: u32, state: ReplicaState) -> Replica {
    let name = format!("v-r-{i}");
    let mut r = Replica::new(
        name.clone(),
        ReplicaSpec {
            volume: "v".into(),
            node: format!("node-{node}"),
            disk: "disk-0".into(),
            data_path: format!("/data/node-{node}/disk-0/replicas/{name}"),
            size: ByteSize(GIB),
        },
    );
    r.metadata
        .finalizers
        .push(zebu_types::names::REPLICA_FINALIZER.into());
    r.status.state = state;
    if state == ReplicaState::Running {
        r.status.address = Some(addr(i, node));
        r.status.pid = Some(100 + i);
    }
    r
}

fn addr(i: u32, node: u32) -> String {
    format!("127.0.0.{}:900{i}", 10 + node)
}

const ENDPOINT: &str = "nbd://127.0.0.11:10809/v";

/// The engine `v-e` on node-1, running with an endpoint, every replica in `modes` as given.
pub fn engine(modes: &[(u32, ReplicaMode)], state: EngineVolumeState) -> Engine {
    let mut e = Engine::new(
        "v-e",
        EngineSpec {
            volume: "v".into(),
            node: "node-1".into(),
            size: ByteSize(GIB),
            replica_addresses: modes
                .iter()
                .map(|(i, _)| (format!("v-r-{i}"), addr(*i, *i)))
                .collect(),
            frontend: Frontend::Nbd,
            disable_frontend: false,
            salvage: false,
        },
    );
    e.metadata
        .finalizers
        .push(zebu_types::names::ENGINE_FINALIZER.into());
    e.status.state = EngineState::Running;
    e.status.pid = Some(50);
    e.status.control_address = Some("127.0.0.11:9600".into());
    e.status.endpoint = Some(ENDPOINT.into());
    e.status.size = Some(ByteSize(GIB));
    e.status.volume_state = Some(state);
    e.status.replica_modes = modes
        .iter()
        .map(|(i, m)| (format!("v-r-{i}"), *m))
        .collect();
    e
}

fn nodes(n: u32) -> Vec<Node> {
    (1..=n).map(ready_node).collect()
}

fn three_running() -> Vec<Replica> {
    (1..=3).map(|i| rep(i, i, ReplicaState::Running)).collect()
}

fn fixture(
    volumes: Vec<Volume>,
    nodes: Vec<Node>,
    replicas: Vec<Replica>,
    engines: Vec<Engine>,
) -> Fixture {
    Fixture {
        now: now(),
        volumes,
        nodes,
        replicas,
        engines,
        settings: vec![],
        presence: None,
        leases_settled: false,
    }
}

/// Presence from Leases: node-`i` for each `(i, down_secs)`, up when `down_secs` is `None`.
fn leases(nodes: &[(u32, Option<u64>)]) -> PresenceMap {
    nodes
        .iter()
        .map(|(i, down)| {
            let p = match down {
                None => Presence::Up,
                Some(secs) => Presence::Down {
                    since: Some(now() - Duration::from_secs(*secs)),
                },
            };
            (format!("node-{i}"), p)
        })
        .collect()
}

fn with_leases(mut f: Fixture, presence: PresenceMap) -> Fixture {
    f.presence = Some(presence);
    f
}

/// The deciding manager has observed the Leases for a whole Lease duration.
fn settled(mut f: Fixture) -> Fixture {
    f.leases_settled = true;
    f
}

fn owned_by(mut v: Volume, node: &str) -> Volume {
    v.status.owner_id = Some(node.to_string());
    v
}

fn case(name: &'static str, fixture: Fixture, target: Target, expect: &[&str]) -> Case {
    Case {
        name,
        fixture,
        target,
        expect: expect.iter().map(|s| s.to_string()).collect(),
    }
}

/// Being deleted, as a store leaves it: `deletionTimestamp` stamped and the generation
/// bumped (Kubernetes does; the store contract follows it).
fn deleting<R: Resource>(mut r: R) -> R {
    let m = r.metadata_mut();
    m.deletion_timestamp = Some(ago(5));
    m.generation = m.generation.max(1) + 1;
    r
}

/// A volume whose status a pass already wrote: in `state`, for its generation (1 when the
/// fixture sets none).
fn with_status(mut v: Volume, state: VolumeState) -> Volume {
    v.status.state = state;
    v.status.observed_generation = v.metadata.generation.max(1);
    v
}

const ALL_RW: [(u32, ReplicaMode); 3] = [
    (1, ReplicaMode::RW),
    (2, ReplicaMode::RW),
    (3, ReplicaMode::RW),
];

/// Every case; see the module docs.
pub fn all() -> Vec<Case> {
    use EngineVolumeState::{Degraded, Faulted, Healthy};
    use ReplicaMode::{ERR, RW};
    use ReplicaState::{Running, Starting};
    let v = Target::Volume("v");
    let mut cases = vec![
        case(
            "a new volume is placed on three nodes",
            fixture(vec![vol(3, None)], nodes(3), vec![], vec![]),
            v.clone(),
            &[
                "create replica on node-1/disk-0 (1 GiB)",
                "create replica on node-2/disk-0 (1 GiB)",
                "create replica on node-3/disk-0 (1 GiB)",
                "status creating unknown Scheduled=True",
            ],
        ),
        case(
            "a volume that cannot be placed says so in its status",
            fixture(vec![vol(4, None)], nodes(3), vec![], vec![]),
            v.clone(),
            &["status creating unknown Scheduled=False"],
        ),
        case(
            "a volume created without its finalizer gets it",
            fixture(
                vec![{
                    let mut x = with_status(vol(3, None), VolumeState::Detached);
                    x.metadata.finalizers.clear();
                    x.status.robustness = zebu_types::resources::Robustness::Healthy;
                    x
                }],
                nodes(3),
                three_running(),
                vec![],
            ),
            v.clone(),
            &["add finalizer", "status detached healthy"],
        ),
        case(
            "attach creates the engine once every replica runs",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![],
            ),
            v.clone(),
            &[
                "create engine on node-1 with v-r-1 v-r-2 v-r-3",
                "status attaching healthy",
            ],
        ),
        case(
            "attach waits while replicas are still starting",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                vec![rep(1, 1, Running), rep(2, 2, Starting), rep(3, 3, Starting)],
                vec![],
            ),
            v.clone(),
            &["status attaching degraded"],
        ),
        case(
            "an attached engine with every replica RW is healthy",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![engine(&ALL_RW, Healthy)],
            ),
            v.clone(),
            &["status attached healthy on node-1 at nbd://127.0.0.11:10809/v"],
        ),
        case(
            "detach stops the engine",
            fixture(
                vec![with_status(vol(3, None), VolumeState::Attached)],
                nodes(3),
                three_running(),
                vec![engine(&ALL_RW, Healthy)],
            ),
            v.clone(),
            &["delete v-e", "status detaching healthy"],
        ),
        case(
            "heal: a replica the engine failed is added back",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![engine(&[(1, RW), (2, ERR), (3, RW)], Degraded)],
            ),
            v.clone(),
            &[
                "add v-r-2 to the engine (was ERR)",
                "status attached degraded on node-1 at nbd://127.0.0.11:10809/v",
            ],
        ),
        case(
            "heal: a running replica the engine does not have is added",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![engine(&[(1, RW), (3, RW)], Healthy)],
            ),
            v.clone(),
            &[
                "add v-r-2 to the engine (was absent)",
                "status attached degraded on node-1 at nbd://127.0.0.11:10809/v",
            ],
        ),
        case(
            "an address no replica owns is removed from the engine",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![{
                    let mut e = engine(&ALL_RW, Healthy);
                    e.status
                        .unknown_replicas
                        .insert("127.0.0.19:9009".into(), ERR);
                    e
                }],
            ),
            v.clone(),
            &[
                "remove 127.0.0.19:9009 from the engine",
                "status attached healthy on node-1 at nbd://127.0.0.11:10809/v",
            ],
        ),
        case(
            "a replica restarted since the engine took it is not healthy yet",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![{
                    let mut e = engine(&ALL_RW, Healthy);
                    e.status.replica_pids.insert("v-r-2".into(), 7);
                    e
                }],
            ),
            v.clone(),
            &["status attached degraded on node-1 at nbd://127.0.0.11:10809/v"],
        ),
        case(
            "a replica whose node is down longer than staleReplicaTimeout is replaced",
            fixture(
                vec![with_status(vol(3, None), VolumeState::Detached)],
                vec![
                    ready_node(1),
                    ready_node(2),
                    down_node(3, 120),
                    ready_node(4),
                ],
                three_running(),
                vec![],
            ),
            v.clone(),
            &[
                "supersede v-r-3",
                "create replica on node-4/disk-0 (1 GiB)",
                "status detached degraded Scheduled=True",
            ],
        ),
        case(
            "a replica whose node is down shorter than staleReplicaTimeout is waited for",
            fixture(
                vec![with_status(vol(3, None), VolumeState::Detached)],
                vec![
                    ready_node(1),
                    ready_node(2),
                    down_node(3, 30),
                    ready_node(4),
                ],
                three_running(),
                vec![],
            ),
            v.clone(),
            &["status detached healthy"],
        ),
        case(
            "a superseded replica goes once its replacement is RW",
            fixture(
                vec![vol(3, Some("node-1"))],
                vec![
                    ready_node(1),
                    ready_node(2),
                    down_node(3, 120),
                    ready_node(4),
                ],
                vec![
                    rep(1, 1, Running),
                    rep(2, 2, Running),
                    {
                        let mut r = rep(3, 3, Running);
                        r.metadata
                            .labels
                            .insert(SUPERSEDED_LABEL.into(), "true".into());
                        r
                    },
                    rep(4, 4, Running),
                ],
                vec![engine(&[(1, RW), (2, RW), (4, RW)], Healthy)],
            ),
            v.clone(),
            &[
                "delete v-r-3 by force",
                "status attached healthy on node-1 at nbd://127.0.0.11:10809/v",
            ],
        ),
        case(
            "a faulted engine with every replica up is salvaged, the decision written first",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![engine(&[(1, ERR), (2, ERR), (3, ERR)], Faulted)],
            ),
            v.clone(),
            &[
                "status creating unknown Salvaging=True",
                "delete v-e",
                "status attached faulted on node-1 at nbd://127.0.0.11:10809/v Salvaging=True",
            ],
        ),
        case(
            "an engine that cannot show a replica current is restarted with --salvage",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![{
                    let mut e = engine(&ALL_RW, Healthy);
                    e.status.state = EngineState::Error;
                    e.status.message =
                        "no replica can be shown current; start with --salvage".into();
                    e
                }],
            ),
            v.clone(),
            &[
                "update v-e: size 1 GiB v-r-1 v-r-2 v-r-3 salvage",
                "status attaching healthy",
            ],
        ),
        case(
            "delete: the engine goes first",
            fixture(
                vec![deleting(vol(3, Some("node-1")))],
                nodes(3),
                three_running(),
                vec![engine(&ALL_RW, Healthy)],
            ),
            v.clone(),
            &["status deleting unknown", "delete v-e"],
        ),
        case(
            "delete: then the replicas, by force where no agent runs",
            fixture(
                vec![with_status(deleting(vol(3, None)), VolumeState::Deleting)],
                vec![ready_node(1), ready_node(2), down_node(3, 5)],
                three_running(),
                vec![],
            ),
            v.clone(),
            &["delete v-r-1", "delete v-r-2", "delete v-r-3 by force"],
        ),
        case(
            "delete: replicas being removed by their agents are waited for",
            fixture(
                vec![with_status(deleting(vol(3, None)), VolumeState::Deleting)],
                nodes(3),
                three_running().into_iter().map(deleting).collect(),
                vec![],
            ),
            v.clone(),
            &[],
        ),
        case(
            "delete: the volume's finalizer goes last",
            fixture(
                vec![with_status(deleting(vol(3, None)), VolumeState::Deleting)],
                nodes(3),
                vec![],
                vec![],
            ),
            v.clone(),
            &["remove finalizer"],
        ),
        case(
            "attach for maintenance starts the engine without a frontend",
            fixture(
                vec![{
                    let mut x = vol(3, Some("node-1"));
                    x.spec.disable_frontend = true;
                    x
                }],
                nodes(3),
                three_running(),
                vec![],
            ),
            v.clone(),
            &[
                "create engine on node-1 with v-r-1 v-r-2 v-r-3 without frontend",
                "status attaching healthy",
            ],
        ),
        case(
            "an engine without a frontend is attached with no endpoint",
            fixture(
                vec![{
                    let mut x = vol(3, Some("node-1"));
                    x.spec.disable_frontend = true;
                    x
                }],
                nodes(3),
                three_running(),
                vec![{
                    let mut e = engine(&ALL_RW, Healthy);
                    e.spec.disable_frontend = true;
                    e.status.endpoint = None;
                    e
                }],
            ),
            v.clone(),
            &["status attached healthy on node-1"],
        ),
        case(
            "attaching with a frontend restarts an engine that has none",
            fixture(
                vec![vol(3, Some("node-1"))],
                nodes(3),
                three_running(),
                vec![{
                    let mut e = engine(&ALL_RW, Healthy);
                    e.spec.disable_frontend = true;
                    e.status.endpoint = None;
                    e
                }],
            ),
            v.clone(),
            &["delete v-e", "status attaching healthy"],
        ),
        case(
            "after an expansion the engine and replicas follow the engine's size",
            fixture(
                vec![{
                    let mut x = vol(3, Some("node-1"));
                    x.spec.size = ByteSize(2 * GIB);
                    x
                }],
                nodes(3),
                three_running(),
                vec![{
                    let mut e = engine(&ALL_RW, Healthy);
                    e.status.size = Some(ByteSize(2 * GIB));
                    e
                }],
            ),
            v.clone(),
            &[
                "resize v-r-1 to 2 GiB",
                "resize v-r-2 to 2 GiB",
                "resize v-r-3 to 2 GiB",
                "update v-e: size 2 GiB v-r-1 v-r-2 v-r-3",
                "status attached healthy on node-1 at nbd://127.0.0.11:10809/v",
            ],
        ),
        case(
            "a detached volume's replicas follow the size its engine grew it to",
            fixture(
                vec![{
                    let mut x = with_status(vol(3, None), VolumeState::Detached);
                    x.spec.size = ByteSize(2 * GIB);
                    x
                }],
                nodes(3),
                three_running(),
                vec![],
            ),
            v.clone(),
            &[
                "resize v-r-1 to 2 GiB",
                "resize v-r-2 to 2 GiB",
                "resize v-r-3 to 2 GiB",
                "status detached healthy",
            ],
        ),
    ];
    // Node controller.
    let quiet = |secs| {
        let mut n = ready_node(1);
        n.status.last_heartbeat = Some(ago(secs));
        n
    };
    cases.extend([
        case(
            "a node silent for longer than node-down-after is marked not ready",
            fixture(vec![], vec![quiet(12)], vec![], vec![]),
            Target::Node("node-1"),
            &["not ready: no heartbeat for 10 s"],
        ),
        case(
            "a node that heartbeats is left alone",
            fixture(vec![], vec![quiet(2)], vec![], vec![]),
            Target::Node("node-1"),
            &[],
        ),
        case(
            "a node already not ready is not marked again",
            fixture(vec![], vec![down_node(1, 30)], vec![], vec![]),
            Target::Node("node-1"),
            &[],
        ),
        case(
            "node-down-after is what the controller waits",
            Fixture {
                settings: vec![Setting::new(
                    "node-down-after",
                    SettingSpec { value: "60".into() },
                )],
                ..fixture(vec![], vec![quiet(70)], vec![], vec![])
            },
            Target::Node("node-1"),
            &["not ready: no heartbeat for 60 s"],
        ),
        case(
            "node-down-after: 12 s of silence is within 60 s",
            Fixture {
                settings: vec![Setting::new(
                    "node-down-after",
                    SettingSpec { value: "60".into() },
                )],
                ..fixture(vec![], vec![quiet(12)], vec![], vec![])
            },
            Target::Node("node-1"),
            &[],
        ),
    ]);
    cases.extend(cluster_cases());
    // Orphans.
    cases.extend([
        case(
            "an engine whose volume is gone is deleted",
            fixture(vec![], nodes(1), vec![], vec![engine(&ALL_RW, Healthy)]),
            Target::Engine("v-e"),
            &["delete orphan v-e"],
        ),
        case(
            "a replica whose volume is gone waits for the engine to go",
            fixture(
                vec![],
                nodes(1),
                three_running(),
                vec![engine(&ALL_RW, Healthy)],
            ),
            Target::Replica("v-r-1"),
            &[],
        ),
        case(
            "a replica whose volume and engine are gone is deleted",
            fixture(vec![], nodes(1), three_running(), vec![]),
            Target::Replica("v-r-1"),
            &["delete orphan v-r-1"],
        ),
    ]);
    cases
}

/// Cases of a cluster of managers: presence from node Leases, and volume ownership. The
/// rendezvous winner for volume `v` is node-1 among node-1…3 and among node-1…2, and node-2
/// among node-2…3.
fn cluster_cases() -> Vec<Case> {
    use EngineVolumeState::Healthy;
    let v = Target::Volume("v");
    let owner = |me| Target::Owner { volume: "v", me };
    let all_up = leases(&[(1, None), (2, None), (3, None)]);
    let node1_gone = leases(&[(1, Some(20)), (2, None), (3, None)]);
    let attached = || {
        fixture(
            vec![vol(3, Some("node-1"))],
            nodes(3),
            three_running(),
            vec![engine(&ALL_RW, Healthy)],
        )
    };
    let attached_owned = |by: &str| {
        let mut f = attached();
        f.volumes = vec![owned_by(vol(3, Some("node-1")), by)];
        f
    };
    let detached = || {
        fixture(
            vec![with_status(vol(3, None), VolumeState::Detached)],
            nodes(3),
            three_running(),
            vec![],
        )
    };
    vec![
        // Ownership.
        case(
            "an attached volume nobody owns is claimed by its attached node's manager",
            with_leases(attached(), all_up.clone()),
            owner("node-1"),
            &["claim"],
        ),
        case(
            "an attached volume nobody owns is left to its attached node's manager",
            with_leases(attached(), all_up.clone()),
            owner("node-2"),
            &["leave (no owner)"],
        ),
        case(
            "the owner drives its volume",
            with_leases(attached_owned("node-1"), all_up.clone()),
            owner("node-1"),
            &["drive"],
        ),
        case(
            "the attached node's manager gone, the rendezvous winner among live managers claims",
            with_leases(attached_owned("node-1"), node1_gone.clone()),
            owner("node-2"),
            &["claim from node-1"],
        ),
        case(
            "the attached node's manager gone, the other live managers leave the volume",
            with_leases(attached_owned("node-1"), node1_gone.clone()),
            owner("node-3"),
            &["leave (owner node-1)"],
        ),
        case(
            "a renewed Lease decides, not a Ready=False left from before the manager came back",
            with_leases(
                {
                    let mut f = attached_owned("node-1");
                    f.nodes[0] = down_node(1, 30);
                    f
                },
                all_up.clone(),
            ),
            owner("node-1"),
            &["drive"],
        ),
        case(
            "the killed manager back: the interim owner hands the volume back",
            with_leases(attached_owned("node-2"), all_up.clone()),
            owner("node-2"),
            &["hand off to node-1"],
        ),
        case(
            "the killed manager back: it waits for the hand-off, never takes from a live owner",
            with_leases(attached_owned("node-2"), all_up.clone()),
            owner("node-1"),
            &["leave (owner node-2)"],
        ),
        case(
            "a detached volume is claimed by the rendezvous winner",
            with_leases(detached(), all_up.clone()),
            owner("node-1"),
            &["claim"],
        ),
        case(
            "a detached volume is left by managers the rendezvous did not pick",
            with_leases(detached(), all_up.clone()),
            owner("node-3"),
            &["leave (no owner)"],
        ),
        case(
            "a detached volume's owner hands it to the new rendezvous winner when that one comes up",
            with_leases(
                {
                    let mut f = detached();
                    f.volumes = vec![owned_by(
                        with_status(vol(3, None), VolumeState::Detached),
                        "node-2",
                    )];
                    f
                },
                all_up.clone(),
            ),
            owner("node-2"),
            &["hand off to node-1"],
        ),
        case(
            "a detached volume stays with its owner while the winner is down",
            with_leases(
                {
                    let mut f = detached();
                    f.volumes = vec![owned_by(
                        with_status(vol(3, None), VolumeState::Detached),
                        "node-2",
                    )];
                    f
                },
                leases(&[(1, Some(5)), (2, None), (3, None)]),
            ),
            owner("node-2"),
            &["drive"],
        ),
        case(
            "a volume being detached is owned by its engine's node while that is up",
            with_leases(
                fixture(
                    vec![with_status(vol(3, None), VolumeState::Attached)],
                    nodes(3),
                    three_running(),
                    vec![engine(&ALL_RW, Healthy)],
                ),
                all_up.clone(),
            ),
            owner("node-1"),
            &["claim"],
        ),
        case(
            "an owner whose Lease this manager has not read yet (it started after the last read) is not taken from",
            with_leases(attached_owned("node-2"), leases(&[(1, None)])),
            owner("node-1"),
            &["leave (owner node-2)"],
        ),
        case(
            "an owner seen neither as a Lease nor as a Node is not taken from on that alone (a lagging cache)",
            with_leases(attached_owned("node-9"), all_up.clone()),
            owner("node-1"),
            &["leave (owner node-9)"],
        ),
        case(
            "an owner still seen neither as a Lease nor as a Node after a whole Lease duration of observation is claimed",
            settled(with_leases(attached_owned("node-9"), all_up.clone())),
            owner("node-1"),
            &["claim from node-9"],
        ),
        // Volume decisions when a node's manager is gone but its processes may run.
        case(
            "the owner observes an engine whose node's manager is gone",
            with_leases(attached_owned("node-2"), node1_gone.clone()),
            v.clone(),
            &[
                "observe v-e",
                "status attached healthy on node-1 at nbd://127.0.0.11:10809/v",
            ],
        ),
        case(
            "a replica whose node's manager is gone too long but that the engine has RW stays",
            with_leases(
                attached_owned("node-1"),
                leases(&[(1, None), (2, None), (3, Some(120))]),
            ),
            v.clone(),
            &["status attached healthy on node-1 at nbd://127.0.0.11:10809/v"],
        ),
        case(
            "a replica whose node's manager is gone too long and that the engine failed is replaced",
            with_leases(
                fixture(
                    vec![vol(3, Some("node-1"))],
                    nodes(4),
                    three_running(),
                    vec![engine(
                        &[
                            (1, ReplicaMode::RW),
                            (2, ReplicaMode::RW),
                            (3, ReplicaMode::ERR),
                        ],
                        EngineVolumeState::Degraded,
                    )],
                ),
                leases(&[(1, None), (2, None), (3, Some(120)), (4, None)]),
            ),
            v.clone(),
            &[
                "supersede v-r-3",
                "create replica on node-4/disk-0 (1 GiB)",
                "status attached degraded on node-1 at nbd://127.0.0.11:10809/v Scheduled=True",
            ],
        ),
        case(
            "a replica is not placed on a node whose Lease expired, whatever its Ready says",
            with_leases(
                fixture(vec![vol(3, None)], nodes(4), vec![], vec![]),
                leases(&[(1, Some(20)), (2, None), (3, None), (4, None)]),
            ),
            v.clone(),
            &[
                "create replica on node-2/disk-0 (1 GiB)",
                "create replica on node-3/disk-0 (1 GiB)",
                "create replica on node-4/disk-0 (1 GiB)",
                "status creating unknown Scheduled=True",
            ],
        ),
        case(
            "replicas on nodes whose Lease and Node this manager has not read yet stay (its caches lag)",
            with_leases(
                fixture(
                    vec![owned_by(vol(3, Some("node-1")), "node-1")],
                    nodes(1),
                    three_running(),
                    vec![],
                ),
                leases(&[(1, None)]),
            ),
            v.clone(),
            &[
                "create engine on node-1 with v-r-1 v-r-2 v-r-3",
                "status attaching healthy",
            ],
        ),
        // The node controller follows Leases.
        case(
            "a node whose Lease this manager has not read yet keeps its Ready",
            with_leases(
                fixture(vec![], nodes(2), vec![], vec![]),
                leases(&[(1, None)]),
            ),
            Target::Node("node-2"),
            &[],
        ),
        case(
            "a node whose Lease expired is marked not ready",
            with_leases(
                fixture(vec![], nodes(2), vec![], vec![]),
                leases(&[(1, Some(20)), (2, None)]),
            ),
            Target::Node("node-1"),
            &["not ready: Lease zebu-node-node-1 expired"],
        ),
        case(
            "a node whose Lease is renewed again is marked ready",
            with_leases(
                fixture(vec![], vec![down_node(1, 30)], vec![], vec![]),
                leases(&[(1, None)]),
            ),
            Target::Node("node-1"),
            &["ready: lease renewed"],
        ),
        case(
            "with Leases, a node without heartbeats is left alone while its Lease is renewed",
            with_leases(
                fixture(
                    vec![],
                    vec![{
                        let mut n = ready_node(1);
                        n.status.last_heartbeat = Some(ago(600));
                        n
                    }],
                    vec![],
                    vec![],
                ),
                leases(&[(1, None)]),
            ),
            Target::Node("node-1"),
            &[],
        ),
    ]
}

/// The decision for `target`, one line per action.
pub fn decide_lines(w: &World, target: &Target) -> Result<Vec<String>, String> {
    let lines = |v: Vec<String>| Ok(v);
    match target {
        Target::Volume(n) => {
            let v = w.volume(n).ok_or(format!("no volume {n}"))?;
            lines(
                volume::decide(w, v)
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            )
        }
        Target::Node(n) => {
            let x = w.node(n).ok_or(format!("no node {n}"))?;
            lines(node::decide(w, x).iter().map(ToString::to_string).collect())
        }
        Target::Engine(n) => {
            let e = w.engine(n).ok_or(format!("no engine {n}"))?;
            lines(
                gc::decide_engine(w, e)
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            )
        }
        Target::Owner { volume, me } => {
            let v = w.volume(volume).ok_or(format!("no volume {volume}"))?;
            lines(vec![ownership::decide(w, v, me).to_string()])
        }
        Target::Replica(n) => {
            let r = w.replica(n).ok_or(format!("no replica {n}"))?;
            lines(
                gc::decide_replica(w, r)
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            )
        }
    }
}

fn compare(case: &Case, got: Vec<String>) -> Result<(), String> {
    if got == case.expect {
        Ok(())
    } else {
        Err(format!(
            "{}:\n  expected {:#?}\n  decided  {:#?}",
            case.name, case.expect, got
        ))
    }
}

/// Run a case on a world built directly from its objects.
pub fn check(case: &Case) -> Result<(), String> {
    let f = case.fixture.clone();
    let mut w = World::from_objects(
        f.now,
        f.volumes,
        f.nodes,
        f.replicas,
        f.engines,
        &f.settings,
    )
    .map_err(|e| format!("{}: {e}", case.name))?;
    if let Some(p) = f.presence {
        w = w.with_presence(p).with_leases_settled(f.leases_settled);
    }
    compare(case, decide_lines(&w, &case.target)?)
}

#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    #[error("writing the case's objects: {0}")]
    Store(#[from] StoreError),
    #[error(transparent)]
    World(#[from] WorldError),
    #[error("{0}")]
    Mismatch(String),
}

/// Write one object as a client and its controllers would: create (the store ignores
/// status there), then the status, then a delete if it is being deleted.
async fn write<R: Resource>(
    store: &dyn Store,
    obj: &R,
    status_of: impl Fn(&R, &mut R),
) -> Result<(), StoreError> {
    let mut fresh = obj.clone();
    let deleting = fresh.metadata_mut().deletion_timestamp.take().is_some();
    let mut created = store.create_as(&fresh).await?;
    status_of(obj, &mut created);
    let updated = store.update_status_as(&created).await?;
    if deleting {
        store.delete(R::KIND, updated.name()).await?;
    }
    Ok(())
}

/// Write a case's objects into `store` (which should be empty).
pub async fn load_into(store: &dyn Store, f: &Fixture) -> Result<(), StoreError> {
    for s in &f.settings {
        store.create_as(s).await?;
    }
    for n in &f.nodes {
        write(store, n, |o, c| c.status = o.status.clone()).await?;
    }
    for v in &f.volumes {
        write(store, v, |o, c| c.status = o.status.clone()).await?;
    }
    for r in &f.replicas {
        write(store, r, |o, c| c.status = o.status.clone()).await?;
    }
    for e in &f.engines {
        write(store, e, |o, c| c.status = o.status.clone()).await?;
    }
    Ok(())
}

/// Run a case on a world loaded from `store` after writing the case's objects into it.
pub async fn check_on_store(case: &Case, store: &dyn Store) -> Result<(), CaseError> {
    load_into(store, &case.fixture).await?;
    let mut w = World::load(store, case.fixture.now).await?;
    if let Some(p) = case.fixture.presence.clone() {
        w = w
            .with_presence(p)
            .with_leases_settled(case.fixture.leases_settled);
    }
    let got = decide_lines(&w, &case.target).map_err(CaseError::Mismatch)?;
    compare(case, got).map_err(CaseError::Mismatch)
}
