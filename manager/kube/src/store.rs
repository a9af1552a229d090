//! [`KubeStore`]: the [`Store`] contract over the Kubernetes API server.
//!
//! Every kind is a custom resource (`deploy/crds/`) in the store's namespace. The mapping:
//!
//! | contract | API server |
//! |---|---|
//! | `get`, `list` | the kind's reflector cache ([`crate::cache`]) once it has listed; without a cache, GET / LIST with `labelSelector` |
//! | `watch(kind, since)` | WATCH from `since` with bookmarks; `410 Gone` → [`StoreError::Expired`] |
//! | `create` | POST (the server ignores `status`: status subresource) |
//! | `update` | PUT with the caller's resourceVersion (409 → [`StoreError::Conflict`]); refused here without one, because the server would take a PUT without one unconditionally |
//! | `update_status` | PUT on `/status`, with `status.display` derived ([`crate::present`]) |
//! | `delete` | DELETE; with finalizers the server only stamps `deletionTimestamp`, and removes the object with the update that drops the last one, as the embedded store does |
//! | errors | 404 → not found, 409 → conflict or already exists, 403 → [`StoreError::Forbidden`] naming the verb and kind, 422 → invalid, 5xx and connection errors → unavailable |
//!
//! Checks the server would make differently are made here first, so both backends give
//! the same errors: the name rules, the namespace, no resourceVersion on create and one on
//! update. One difference remains, documented in `zebu_types::meta`: the API server's
//! garbage collector deletes objects whose owner is gone, which the embedded store leaves
//! to the controllers.
//!
//! A write returns once the kind's cache has applied it, and a watch event is handed out
//! once the cache has applied it, so `get`/`list` after either see at least that state
//! (see the cache's docs for the consistency this gives).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, PostParams, WatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use serde_json::Value;
use tokio::task::JoinHandle;
use zebu_types::store::{
    BoxFuture, ListParams, ObjectList, Result, SecretLookup, Store, StoreError, WatchEvent,
    WatchStream, object_version,
};
use zebu_types::{API_VERSION, GROUP, Kind, ResourceVersion, VERSION, validate_object_name};

use crate::cache::{Cache, to_value};
use crate::errors::{Call, map};
use crate::present;

/// How a [`KubeStore`] reads.
#[derive(Debug, Clone)]
pub struct KubeStoreOptions {
    /// Serve `get`/`list` from reflector caches (a manager); `false` asks the server every
    /// time (a one-shot CLI call, where a cache would be filled for one read).
    pub cached: bool,
    /// How long a first read of a kind waits for its cache's first list.
    pub sync_timeout: Duration,
    /// How long a write waits for its cache to apply it before returning anyway (the write
    /// is done; only read-your-writes is late, and a stale read costs a conflict).
    pub visible_timeout: Duration,
}

impl Default for KubeStoreOptions {
    fn default() -> Self {
        KubeStoreOptions {
            cached: true,
            sync_timeout: Duration::from_secs(30),
            visible_timeout: Duration::from_secs(10),
        }
    }
}

/// The Kubernetes store; see the module docs. Cheap to clone; clones share the caches.
#[derive(Clone)]
pub struct KubeStore {
    inner: Arc<Inner>,
    /// Volume secrets (issue 18), as Secrets of the store's namespace.
    secrets: Arc<crate::secrets::KubeSecrets>,
}

/// A kind's cache and the task that fills it.
type CacheTask = (Arc<Cache>, JoinHandle<()>);

struct Inner {
    client: kube::Client,
    namespace: String,
    options: KubeStoreOptions,
    caches: Mutex<HashMap<Kind, CacheTask>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let caches = self.caches.get_mut().unwrap_or_else(|p| p.into_inner());
        for (_, task) in caches.values() {
            task.abort();
        }
    }
}

/// The API resource of `kind`.
pub fn api_resource(kind: Kind) -> ApiResource {
    ApiResource {
        group: GROUP.to_string(),
        version: VERSION.to_string(),
        api_version: API_VERSION.to_string(),
        kind: kind.as_str().to_string(),
        plural: kind.plural().to_string(),
    }
}

fn config_error(
    context: &'static str,
    e: impl std::error::Error + Send + Sync + 'static,
) -> StoreError {
    StoreError::Backend {
        context,
        source: Box::new(e),
    }
}

fn to_dynamic(kind: Kind, name: &str, v: Value) -> Result<DynamicObject> {
    serde_json::from_value(v).map_err(|source| StoreError::Codec {
        what: format!("{kind} {name:?}"),
        source,
    })
}

fn finalizers_left(object: &Value) -> bool {
    object
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty())
}

impl KubeStore {
    /// A client from `kubeconfig` (its current context), or, without one, from the
    /// environment: the in-cluster service account in a pod, else `$KUBECONFIG` or
    /// `~/.kube/config`.
    pub async fn connect(
        kubeconfig: Option<&Path>,
        namespace: &str,
        options: KubeStoreOptions,
    ) -> Result<Self> {
        let config = match kubeconfig {
            Some(path) => {
                let file = Kubeconfig::read_from(path)
                    .map_err(|e| config_error("reading the kubeconfig", e))?;
                kube::Config::from_custom_kubeconfig(file, &KubeConfigOptions::default())
                    .await
                    .map_err(|e| config_error("loading the kubeconfig", e))?
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| config_error("finding a Kubernetes configuration", e))?,
        };
        let client = crate::client::from_config(config)
            .map_err(|e| config_error("making a Kubernetes client", e))?;
        Ok(Self::new(client, namespace, options))
    }

    pub fn new(client: kube::Client, namespace: &str, options: KubeStoreOptions) -> Self {
        KubeStore {
            secrets: Arc::new(crate::secrets::KubeSecrets::new(
                client.clone(),
                namespace,
                None,
            )),
            inner: Arc::new(Inner {
                client,
                namespace: namespace.to_string(),
                options,
                caches: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Where this node copies the volume secrets its processes are started with
    /// (`<data-dir>/secrets`); without one, secrets can be made and deleted but not used.
    pub fn with_secret_dir(mut self, dir: std::path::PathBuf) -> Self {
        self.secrets = Arc::new(crate::secrets::KubeSecrets::new(
            self.inner.client.clone(),
            &self.inner.namespace,
            Some(dir),
        ));
        self
    }

    fn api(&self, kind: Kind) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.inner.client.clone(),
            &self.inner.namespace,
            &api_resource(kind),
        )
    }

    /// The cache of `kind`, started on first use; `None` when the store reads uncached.
    fn cache(&self, kind: Kind) -> Option<Arc<Cache>> {
        if !self.inner.options.cached {
            return None;
        }
        let mut caches = self.inner.caches.lock().unwrap_or_else(|p| p.into_inner());
        let (cache, _) = caches.entry(kind).or_insert_with(|| {
            let cache = Cache::new(kind);
            let task = tokio::spawn(cache.clone().run(self.api(kind)));
            (cache, task)
        });
        Some(cache.clone())
    }

    /// The cache of `kind` once it serves.
    async fn ready_cache(&self, kind: Kind) -> Result<Option<Arc<Cache>>> {
        match self.cache(kind) {
            Some(c) => {
                c.ready(self.inner.options.sync_timeout).await?;
                Ok(Some(c))
            }
            None => Ok(None),
        }
    }

    /// Events the cache of `kind` applied and lists it repeated after an expiry (tests).
    pub fn cache_counters(&self, kind: Kind) -> Option<(u64, u64)> {
        let caches = self.inner.caches.lock().unwrap_or_else(|p| p.into_inner());
        caches.get(&kind).map(|(c, _)| c.counters())
    }

    /// Return once the cache of `kind` reflects a write (or after the timeout, logged).
    async fn visible(&self, kind: Kind, name: &str, version: Option<&ResourceVersion>) {
        let Some(cache) = self.cache(kind) else {
            return;
        };
        if !cache
            .wait_for(name, version, self.inner.options.visible_timeout)
            .await
        {
            tracing::warn!(
                %kind, name,
                "the cache did not show a write within {:?}; reads may be stale until it does",
                self.inner.options.visible_timeout
            );
        }
    }

    /// Kind and name of an incoming object, checked as the embedded store checks them, its
    /// namespace and apiVersion stamped.
    fn identify(&self, object: &mut Value) -> Result<(Kind, String)> {
        let kind_str = object
            .get("kind")
            .and_then(Value::as_str)
            .ok_or_else(|| StoreError::invalid(None, "object has no \"kind\""))?;
        let kind = Kind::parse(kind_str)
            .ok_or_else(|| StoreError::invalid(None, format!("unknown kind {kind_str:?}")))?;
        let name = object
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .ok_or_else(|| StoreError::invalid(Some(kind), "no metadata.name"))?
            .to_string();
        validate_object_name(&name).map_err(|source| StoreError::InvalidName { kind, source })?;
        let ns = &self.inner.namespace;
        let meta = object
            .get_mut("metadata")
            .and_then(Value::as_object_mut)
            .ok_or_else(|| StoreError::invalid(Some(kind), "metadata is not an object"))?;
        match meta.get("namespace").and_then(Value::as_str) {
            Some(given) if given != ns => {
                return Err(StoreError::invalid(
                    Some(kind),
                    format!("{name:?} is in namespace {given:?}; this store holds {ns:?}"),
                ));
            }
            _ => {
                meta.insert("namespace".into(), Value::from(ns.as_str()));
            }
        }
        object["apiVersion"] = Value::from(API_VERSION);
        Ok((kind, name))
    }

    async fn get_impl(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        if let Some(cache) = self.ready_cache(kind).await? {
            return Ok(cache.get(name));
        }
        match self.api(kind).get_opt(name).await {
            Ok(o) => o.map(|o| to_value(kind, o)).transpose(),
            Err(e) => Err(map(Call::new("get", kind, name), e)),
        }
    }

    async fn list_impl(&self, kind: Kind, params: &ListParams) -> Result<ObjectList> {
        if let Some(cache) = self.ready_cache(kind).await? {
            let (items, resource_version) = cache.list(|o| {
                params
                    .label_selector
                    .as_ref()
                    .is_none_or(|s| s.matches_object(o))
            });
            return Ok(ObjectList {
                items,
                resource_version,
            });
        }
        let mut lp = kube::api::ListParams::default();
        if let Some(s) = params.label_selector.as_ref().filter(|s| !s.is_empty()) {
            lp = lp.labels(&s.to_string());
        }
        let list = self
            .api(kind)
            .list(&lp)
            .await
            .map_err(|e| map(Call::new("list", kind, ""), e))?;
        let mut items = list
            .items
            .into_iter()
            .map(|o| to_value(kind, o))
            .collect::<Result<Vec<_>>>()?;
        items.sort_by(|a, b| {
            zebu_types::store::object_name(a).cmp(zebu_types::store::object_name(b))
        });
        Ok(ObjectList {
            items,
            resource_version: ResourceVersion::new(
                list.metadata.resource_version.unwrap_or_default(),
            ),
        })
    }

    async fn watch_impl(&self, kind: Kind, since: &ResourceVersion) -> Result<WatchStream> {
        let params = WatchParams::default().timeout(290);
        let stream = self
            .api(kind)
            .watch(&params, since.as_str())
            .await
            .map_err(|e| map(Call::new("watch", kind, "").at(since), e))?;
        let store = self.clone();
        let since = since.clone();
        let events = stream
            .then(move |item| {
                let store = store.clone();
                let since = since.clone();
                async move {
                    let ev = match item {
                        Ok(kube::api::WatchEvent::Added(o)) => {
                            WatchEvent::Added(to_value(kind, o)?)
                        }
                        Ok(kube::api::WatchEvent::Modified(o)) => {
                            WatchEvent::Modified(to_value(kind, o)?)
                        }
                        Ok(kube::api::WatchEvent::Deleted(o)) => {
                            WatchEvent::Deleted(to_value(kind, o)?)
                        }
                        Ok(kube::api::WatchEvent::Bookmark(b)) => {
                            WatchEvent::Bookmark(ResourceVersion::new(b.metadata.resource_version))
                        }
                        Ok(kube::api::WatchEvent::Error(s)) => {
                            return Err(map(
                                Call::new("watch", kind, "").at(&since),
                                kube::Error::Api(s),
                            ));
                        }
                        Err(e) => return Err(map(Call::new("watch", kind, "").at(&since), e)),
                    };
                    // Hand the event out once the cache shows it, so a reader woken by it
                    // sees at least this state.
                    if let Some(o) = ev.object() {
                        let name = zebu_types::store::object_name(o).to_string();
                        let rv = object_version(o);
                        let gone = matches!(ev, WatchEvent::Deleted(_));
                        store
                            .visible(kind, &name, if gone { None } else { Some(&rv) })
                            .await;
                    }
                    Ok(ev)
                }
            })
            // A watch error ends the stream: the caller resumes (or lists again on expiry).
            .scan(false, |failed, item: Result<WatchEvent>| {
                let out = if *failed { None } else { Some(item) };
                if matches!(out, Some(Err(_))) {
                    *failed = true;
                }
                futures::future::ready(out)
            });
        Ok(Box::pin(events))
    }

    async fn create_impl(&self, mut object: Value) -> Result<Value> {
        let (kind, name) = self.identify(&mut object)?;
        if !object_version(&object).is_empty() {
            return Err(StoreError::invalid(
                Some(kind),
                format!("{name:?}: resourceVersion must not be set on create"),
            ));
        }
        if let Some(o) = object.as_object_mut() {
            o.remove("status");
        }
        if let Some(m) = object.get_mut("metadata").and_then(Value::as_object_mut) {
            for owned in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "generation",
            ] {
                m.remove(owned);
            }
        }
        let created = self
            .api(kind)
            .create(&PostParams::default(), &to_dynamic(kind, &name, object)?)
            .await
            .map_err(|e| map(Call::new("create", kind, &name), e))?;
        let created = to_value(kind, created)?;
        self.visible(kind, &name, Some(&object_version(&created)))
            .await;
        Ok(created)
    }

    async fn update_impl(&self, mut object: Value, status: bool) -> Result<Value> {
        let (kind, name) = self.identify(&mut object)?;
        let given = object_version(&object);
        if given.is_empty() {
            return Err(StoreError::invalid(
                Some(kind),
                format!("{name:?}: resourceVersion must be set for an update"),
            ));
        }
        let api = self.api(kind);
        let pp = PostParams::default();
        let result = if status {
            present::decorate(kind, &mut object);
            let o = to_dynamic(kind, &name, object)?;
            api.replace_status(&name, &pp, &o)
                .await
                .map_err(|e| map(Call::new("update status of", kind, &name).at(&given), e))?
        } else {
            let o = to_dynamic(kind, &name, object)?;
            api.replace(&name, &pp, &o)
                .await
                .map_err(|e| map(Call::new("update", kind, &name).at(&given), e))?
        };
        let updated = to_value(kind, result)?;
        let gone =
            updated.pointer("/metadata/deletionTimestamp").is_some() && !finalizers_left(&updated);
        let rv = object_version(&updated);
        self.visible(kind, &name, if gone { None } else { Some(&rv) })
            .await;
        Ok(updated)
    }

    async fn delete_impl(&self, kind: Kind, name: &str) -> Result<Option<Value>> {
        let answer = self
            .api(kind)
            .delete(name, &DeleteParams::default())
            .await
            .map_err(|e| map(Call::new("delete", kind, name), e))?;
        let kept = match answer {
            either::Either::Left(o) => {
                let v = to_value(kind, o)?;
                let held =
                    v.pointer("/metadata/deletionTimestamp").is_some() && finalizers_left(&v);
                held.then_some(v)
            }
            either::Either::Right(_) => None,
        };
        match &kept {
            Some(v) => self.visible(kind, name, Some(&object_version(v))).await,
            None => self.visible(kind, name, None).await,
        }
        Ok(kept)
    }

    /// A core/v1 Secret of the namespace, read straight from the API server (never cached:
    /// it is read only where credentials are needed, and a changed Secret counts at once).
    async fn secret_impl(&self, name: &str) -> Result<SecretLookup> {
        let api: Api<k8s_openapi::api::core::v1::Secret> =
            Api::namespaced(self.inner.client.clone(), &self.inner.namespace);
        match api.get_opt(name).await {
            Ok(None) => Ok(SecretLookup::Missing),
            Ok(Some(s)) => Ok(SecretLookup::Found(
                s.data
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, v)| (k, v.0))
                    .collect(),
            )),
            // The API server's message names the verb, the resource and the user.
            Err(e) => Err(StoreError::Backend {
                context: "reading a Secret",
                source: Box::new(e),
            }),
        }
    }
}

impl Store for KubeStore {
    fn secret<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<SecretLookup>> {
        Box::pin(self.secret_impl(name))
    }
    fn namespace(&self) -> &str {
        &self.inner.namespace
    }
    fn get<'a>(&'a self, kind: Kind, name: &'a str) -> BoxFuture<'a, Result<Option<Value>>> {
        Box::pin(self.get_impl(kind, name))
    }
    fn list<'a>(&'a self, kind: Kind, params: &'a ListParams) -> BoxFuture<'a, Result<ObjectList>> {
        Box::pin(self.list_impl(kind, params))
    }
    fn watch<'a>(
        &'a self,
        kind: Kind,
        since: &'a ResourceVersion,
    ) -> BoxFuture<'a, Result<WatchStream>> {
        Box::pin(self.watch_impl(kind, since))
    }
    fn create(&self, object: Value) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.create_impl(object))
    }
    fn update(&self, object: Value) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.update_impl(object, false))
    }
    fn update_status(&self, object: Value) -> BoxFuture<'_, Result<Value>> {
        Box::pin(self.update_impl(object, true))
    }
    fn delete<'a>(&'a self, kind: Kind, name: &'a str) -> BoxFuture<'a, Result<Option<Value>>> {
        Box::pin(self.delete_impl(kind, name))
    }
    fn secrets(&self) -> Option<Arc<dyn zebu_types::secrets::SecretKeeper>> {
        Some(self.secrets.clone())
    }
}
