//! Volume ownership among several managers' controllers sharing one real store, their passes
//! run at the same time: exactly one manager drives a volume, ownership moves when the
//! owner's Lease expires and comes back when it returns. Presence is what a test says (the
//! Lease machinery has its own tests against a real API server), everything else is the real
//! pass: the store writes, their resourceVersion conflicts, the volume controller.
//!
//! Double driving shows as double work: two managers that both reconcile a new volume both
//! schedule its replicas.

use std::sync::{Arc, Mutex};

use zebu_controllers::cases;
use zebu_controllers::{Controllers, Membership, Presence, PresenceMap};
use zebu_store::EmbeddedStore;
use zebu_types::Store;
use zebu_types::resources::{Replica, Volume};
use zebu_types::store::TypedStore;

/// Presence as a test sets it, shared by every member; `acting` says which may act.
#[derive(Default)]
struct Fake {
    presence: Mutex<PresenceMap>,
    acting: Mutex<Vec<String>>,
}

struct Member {
    node: String,
    fake: Arc<Fake>,
}

impl Membership for Member {
    fn may_act(&self) -> bool {
        self.fake.acting.lock().expect("lock").contains(&self.node)
    }
    fn presence(&self) -> PresenceMap {
        self.fake.presence.lock().expect("lock").clone()
    }
    fn leads(&self) -> bool {
        self.node == "node-1"
    }
}

impl Fake {
    fn set(&self, up: &[u32]) {
        let mut p = PresenceMap::new();
        for i in 1..=3 {
            let state = if up.contains(&i) {
                Presence::Up
            } else {
                Presence::Down {
                    since: Some(cases::now()),
                }
            };
            p.insert(format!("node-{i}"), state);
        }
        *self.presence.lock().expect("lock") = p;
        *self.acting.lock().expect("lock") = up.iter().map(|i| format!("node-{i}")).collect();
    }
}

async fn cluster() -> (
    tempfile::TempDir,
    Arc<dyn Store>,
    Arc<Fake>,
    Vec<Controllers>,
) {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn Store> =
        Arc::new(EmbeddedStore::open(dir.path().join("z.redb")).expect("open"));
    let fixture = cases::Fixture {
        now: cases::now(),
        volumes: vec![],
        nodes: (1..=3).map(cases::ready_node).collect(),
        replicas: vec![],
        engines: vec![],
        settings: vec![],
        presence: None,
        leases_settled: false,
    };
    cases::load_into(store.as_ref(), &fixture)
        .await
        .expect("nodes");
    let fake = Arc::new(Fake::default());
    fake.set(&[1, 2, 3]);
    let members = (1..=3)
        .map(|i| {
            let node = format!("node-{i}");
            let m = Arc::new(Member {
                node: node.clone(),
                fake: fake.clone(),
            });
            Controllers::member(store.clone(), node, m)
        })
        .collect();
    (dir, store, fake, members)
}

/// One pass of every member, all at once.
async fn passes(members: &mut [Controllers]) {
    let all = members.iter_mut().map(|c| c.pass());
    for r in futures::future::join_all(all).await {
        r.expect("pass");
    }
}

async fn owner(store: &dyn Store) -> Option<String> {
    let v: Volume = store.get_as("v").await.expect("get").expect("volume");
    v.status.owner_id
}

async fn replicas(store: &dyn Store) -> usize {
    let rs: Vec<Replica> = store.list_as().await.expect("list");
    rs.len()
}

#[tokio::test]
async fn one_manager_drives_a_volume_and_ownership_follows_leases_there_and_back() {
    let (_dir, store, fake, mut members) = cluster().await;
    store
        .create_as(&cases::vol(3, Some("node-1")))
        .await
        .expect("volume");
    for _ in 0..5 {
        passes(&mut members).await;
    }
    assert_eq!(owner(store.as_ref()).await.as_deref(), Some("node-1"));
    // Three managers passed five times at once over a new volume: it was placed once.
    assert_eq!(replicas(store.as_ref()).await, 3);

    // node-1's manager is gone: its Lease expired for the others, and it no longer acts.
    fake.set(&[2, 3]);
    for _ in 0..3 {
        passes(&mut members).await;
    }
    // The rendezvous winner among node-2 and node-3 for `v` (see `cases`).
    assert_eq!(owner(store.as_ref()).await.as_deref(), Some("node-2"));
    assert_eq!(replicas(store.as_ref()).await, 3);

    // It comes back: the interim owner hands the volume back.
    fake.set(&[1, 2, 3]);
    for _ in 0..3 {
        passes(&mut members).await;
    }
    assert_eq!(owner(store.as_ref()).await.as_deref(), Some("node-1"));
    assert_eq!(replicas(store.as_ref()).await, 3);
}

#[tokio::test]
async fn without_ownership_concurrent_managers_place_a_volume_twice() {
    // The failure the ownership rules prevent, shown with the same store and passes: three
    // managers that each think they are the only one.
    let (_dir, store, _fake, _members) = cluster().await;
    let mut sole: Vec<Controllers> = (0..3).map(|_| Controllers::new(store.clone())).collect();
    store
        .create_as(&cases::vol(3, Some("node-1")))
        .await
        .expect("volume");
    passes(&mut sole).await;
    assert!(
        replicas(store.as_ref()).await > 3,
        "three sole managers at once placed the volume only once"
    );
}
