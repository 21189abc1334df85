// Package hubtest is an in-process Hugging Face hub: an HTTP server that
// answers the parts of the hub's HTTP API a model downloader uses, the way
// huggingface.co answers them, for tests and benchmarks where the real hub is
// out of reach.
//
// It serves, for model repositories:
//
//	GET  /api/models/{repo_id}[/revision/{revision}]   model info: id, sha, siblings (?blobs=true adds sizes, blob ids, LFS sha256; ?expand= selects properties)
//	GET  /api/models/{repo_id}/tree/{revision}[/{path}] files and directories (?recursive=true), paginated with Link: <…>; rel="next"
//	HEAD /{repo_id}/resolve/{revision}/{path}           X-Repo-Commit, ETag, and for LFS files X-Linked-Etag, X-Linked-Size
//	GET  /{repo_id}/resolve/{revision}/{path}           a git file's bytes, or for an LFS file a 302 to a signed CDN URL
//	GET  /cdn/repos/…/{sha256}?Expires=…&Signature=…    LFS bytes, with Range support
//
// Revisions are branches, tags or 40-hex commits; in URLs they are escaped as
// one path segment ("refs%2Fpr%2F1"), and also found unescaped. Errors carry
// the hub's X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound,
// GatedRepo) and X-Error-Message headers and a {"error": …} body. Private
// repositories answer 401 without their token; gated ones show their metadata
// but answer 401 or 403 to downloads without it.
//
// Files are Content: bytes in memory, generated on demand, or read from disk,
// so a benchmark can serve gigabytes without holding them. Faults can be
// injected per route (Fail), a file can be served corrupted (Corrupt), and
// Stats counts requests and bytes.
//
// The core API takes no *testing.T: New starts the server, Close stops it.
package hubtest

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultPageSize is how many entries a tree listing page holds, as on the
// hub.
const DefaultPageSize = 1000

// Route names a family of endpoints, for faults and statistics.
type Route string

// Routes.
const (
	RouteInfo    Route = "info"    // /api/models/{repo_id}[/revision/{revision}]
	RouteTree    Route = "tree"    // /api/models/{repo_id}/tree/…
	RouteResolve Route = "resolve" // /{repo_id}/resolve/…
	RouteCDN     Route = "cdn"     // /cdn/…
)

// Hub is a running in-process hub. Its methods are safe for concurrent use,
// also while it serves.
type Hub struct {
	// URL is the hub's base URL ("http://127.0.0.1:port"): the endpoint to
	// give a client, as HF_ENDPOINT.
	URL string
	// CDNURL is the base URL LFS downloads are redirected to: URL itself,
	// or a second server's with WithSeparateCDN.
	CDNURL string

	srv, cdn *httptest.Server
	addr     string
	pageSize int
	secret   []byte

	mu      sync.Mutex
	repos   map[string]*Repo
	blobs   map[string]Content // sha256 hex → content, for the CDN
	corrupt map[string]bool    // sha256 hex of content served wrong
	faults  map[Route][]fault
	closers []io.Closer

	stats struct {
		requests  sync.Map // Route → *atomic.Int64
		bytes     atomic.Int64
		cdnBytes  atomic.Int64
		cdnAuthed atomic.Int64
	}
}

// Option configures a Hub.
type Option func(*Hub)

// WithPageSize sets how many entries a tree listing page holds (default
// DefaultPageSize); a small one makes tests exercise pagination.
func WithPageSize(n int) Option {
	return func(h *Hub) {
		if n < 1 {
			panic("hubtest: page size must be positive")
		}
		h.pageSize = n
	}
}

// WithSeparateCDN serves LFS downloads from a second server (another port)
// rather than from the hub's own: a client following the redirect changes
// host, as it does from huggingface.co to its CDN. Like a presigned object
// store URL, that CDN refuses requests that carry an Authorization header
// (400): a client must not send its hub token there.
func WithSeparateCDN() Option {
	return func(h *Hub) {
		h.cdn = httptest.NewUnstartedServer(nil)
	}
}

// WithAddr makes the hub listen on addr ("host:port"; port 0 picks one)
// instead of a free port on 127.0.0.1, so that other processes or network
// namespaces can reach it; a separate CDN listens on the same host. Links
// and redirects name the host the request was sent to, so a hub listening on
// 0.0.0.0 works for clients on any interface. New panics if it cannot listen.
func WithAddr(addr string) Option {
	return func(h *Hub) { h.addr = addr }
}

// New starts a hub with no repositories.
func New(opts ...Option) *Hub {
	h := &Hub{
		pageSize: DefaultPageSize,
		secret:   make([]byte, 32),
		repos:    make(map[string]*Repo),
		blobs:    make(map[string]Content),
		corrupt:  make(map[string]bool),
		faults:   make(map[Route][]fault),
	}
	_, _ = rand.Read(h.secret)
	for _, o := range opts {
		o(h)
	}
	h.srv = httptest.NewUnstartedServer(http.HandlerFunc(h.serveHub))
	host := "127.0.0.1"
	if h.addr != "" {
		h.srv.Listener.Close()
		h.srv.Listener = listen(h.addr)
		host, _, _ = net.SplitHostPort(h.addr)
	}
	h.srv.Start()
	h.URL = h.srv.URL
	h.CDNURL = h.URL
	if h.cdn != nil {
		h.cdn.Config.Handler = http.HandlerFunc(h.serveCDNHost)
		if h.addr != "" {
			h.cdn.Listener.Close()
			h.cdn.Listener = listen(net.JoinHostPort(host, "0"))
		}
		h.cdn.Start()
		h.CDNURL = h.cdn.URL
	}
	return h
}

func listen(addr string) net.Listener {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		panic(fmt.Sprintf("hubtest: %v", err))
	}
	return ln
}

// Serve serves the hub on l as well, until Close: a listener made in
// another network namespace (internal/testbed's Host.Listen) puts the same
// hub, its repositories, faults and counters, within that namespace's reach.
// Links name the host each request was sent to. Not with WithSeparateCDN,
// whose redirects name the CDN's own port.
func (h *Hub) Serve(l net.Listener) {
	if h.cdn != nil {
		panic("hubtest: Serve with WithSeparateCDN")
	}
	srv := &http.Server{Handler: http.HandlerFunc(h.serveHub)}
	h.mu.Lock()
	h.closers = append(h.closers, srv)
	h.mu.Unlock()
	go func() { _ = srv.Serve(l) }()
}

// base is the hub's URL as the client of r sees it.
func (h *Hub) base(r *http.Request) string {
	if r.Host == "" {
		return h.URL
	}
	return "http://" + r.Host
}

// cdnBase is the CDN's URL as the client of r would see it: the hub's own,
// or the separate CDN's port on the host the client named.
func (h *Hub) cdnBase(r *http.Request) string {
	if h.cdn == nil {
		return h.base(r)
	}
	host := r.Host
	if hn, _, err := net.SplitHostPort(host); err == nil {
		host = hn
	}
	if host == "" {
		return h.CDNURL
	}
	_, port, _ := net.SplitHostPort(h.cdn.Listener.Addr().String())
	return "http://" + net.JoinHostPort(strings.Trim(host, "[]"), port)
}

// Close stops the servers and closes the files of FromFile contents added.
func (h *Hub) Close() {
	h.srv.Close()
	if h.cdn != nil {
		h.cdn.Close()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, c := range h.closers {
		c.Close()
	}
	h.closers = nil
}

// Stats are the hub's counters since it started.
type Stats struct {
	// Requests counts requests per route, faults included.
	Requests map[Route]int64
	// Bytes counts the file bytes sent: git files from resolve and LFS
	// files from the CDN.
	Bytes int64
	// CDNBytes counts the LFS bytes sent by the CDN.
	CDNBytes int64
	// CDNAuthorized counts CDN requests that carried an Authorization
	// header: a client that sends its hub token to the CDN.
	CDNAuthorized int64
}

// Stats returns the counters.
func (h *Hub) Stats() Stats {
	s := Stats{
		Requests:      make(map[Route]int64),
		Bytes:         h.stats.bytes.Load(),
		CDNBytes:      h.stats.cdnBytes.Load(),
		CDNAuthorized: h.stats.cdnAuthed.Load(),
	}
	h.stats.requests.Range(func(k, v any) bool {
		s.Requests[k.(Route)] = v.(*atomic.Int64).Load()
		return true
	})
	return s
}

func (h *Hub) count(r Route) {
	v, _ := h.stats.requests.LoadOrStore(r, new(atomic.Int64))
	v.(*atomic.Int64).Add(1)
}

type fault struct {
	status int
	n      int
}

// Fail makes the hub answer the next n requests of route with status (and
// the hub's error headers; a 429 carries "Retry-After: 1"). Faults queue in
// the order given.
func (h *Hub) Fail(route Route, status, n int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.faults[route] = append(h.faults[route], fault{status: status, n: n})
}

// takeFault returns the status of the next queued fault of route, or 0.
func (h *Hub) takeFault(route Route) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	q := h.faults[route]
	for len(q) > 0 && q[0].n <= 0 {
		q = q[1:]
	}
	h.faults[route] = q
	if len(q) == 0 {
		return 0
	}
	q[0].n--
	return q[0].status
}

// Corrupt makes the hub serve the file at path of repository id's main
// branch (or at the given revision) with every byte inverted: same size,
// same headers, wrong bytes, on every route that serves it.
func (h *Hub) Corrupt(id, path string, revision ...string) {
	rev := "main"
	if len(revision) > 0 {
		rev = revision[0]
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f := h.fileLocked(id, rev, path)
	h.corrupt[f.sha256] = true
}

func (h *Hub) fileLocked(id, rev, p string) *file {
	r, ok := h.repos[id]
	if !ok {
		panic(fmt.Sprintf("hubtest: no repository %q", id))
	}
	c := r.commitLocked(rev)
	if c == nil {
		panic(fmt.Sprintf("hubtest: repository %q has no revision %q", id, rev))
	}
	f, ok := c.files[p]
	if !ok {
		panic(fmt.Sprintf("hubtest: %s@%s has no file %q", id, rev, p))
	}
	return f
}

// SHA256 returns the lowercase hex sha256 of a file at a revision.
func (h *Hub) SHA256(id, revision, path string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.fileLocked(id, revision, path).sha256
}

// Repo is a model repository on the hub: commits, and branches and tags
// naming them.
type Repo struct {
	hub     *Hub
	id      string
	private bool
	gated   bool
	token   string
	created time.Time

	// Guarded by hub.mu.
	refs    map[string]string // branch or tag → commit
	commits map[string]*commit
	last    string
}

type commit struct {
	sha   string
	time  time.Time
	title string
	files map[string]*file
	paths []string          // sorted
	dirs  map[string]string // directory path → tree oid
}

type file struct {
	path    string
	content Content
	lfs     bool
	size    int64
	gitOID  string // sha1 of the git blob: the content, or the LFS pointer
	sha256  string
	pointer int // size of the LFS pointer file
}

// RepoOption configures a repository.
type RepoOption func(*Repo)

// Private makes the repository visible only to requests carrying
// "Authorization: Bearer <token>": others get 401 RepoNotFound.
func Private(token string) RepoOption {
	return func(r *Repo) { r.private, r.token = true, token }
}

// Gated lets anyone see the repository's metadata and listings but answers
// downloads (resolve) without token with 401 GatedRepo, and with another
// token with 403 GatedRepo.
func Gated(token string) RepoOption {
	return func(r *Repo) { r.gated, r.token = true, token }
}

var (
	repoPartRE = regexp.MustCompile(`^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?$`)
	refRE      = regexp.MustCompile(`^[A-Za-z0-9._-]+(?:/[A-Za-z0-9._-]+)*$`)
	commitRE   = regexp.MustCompile(`^[0-9a-f]{40}$`)
)

// AddRepo creates the repository id ("org/name" or "name") with one commit
// of files (path → content) on branch "main", and returns it. It panics on an
// invalid or duplicate id or path, or content it cannot read: a fixture error
// is a programming error.
func (h *Hub) AddRepo(id string, files map[string]Content, opts ...RepoOption) *Repo {
	parts := strings.Split(id, "/")
	if len(parts) > 2 {
		panic(fmt.Sprintf("hubtest: repository id %q: want org/name or name", id))
	}
	for _, p := range parts {
		if !repoPartRE.MatchString(p) {
			panic(fmt.Sprintf("hubtest: repository id %q", id))
		}
	}
	r := &Repo{hub: h, id: id, created: time.Now().UTC(), refs: make(map[string]string), commits: make(map[string]*commit)}
	for _, o := range opts {
		o(r)
	}
	h.mu.Lock()
	if _, ok := h.repos[id]; ok {
		h.mu.Unlock()
		panic(fmt.Sprintf("hubtest: repository %q exists", id))
	}
	h.repos[id] = r
	h.mu.Unlock()
	r.Commit("main", "initial commit", files)
	return r
}

// ID returns the repository id.
func (r *Repo) ID() string { return r.id }

// Commit adds a commit holding exactly files (the previous commit's files
// are not carried over), points branch at it (creating the branch) and
// returns the commit's id: 40 hex digits. Branch may be a pull request ref
// such as "refs/pr/1". It reads every file once, to hash it (a second or
// so per GiB). It panics like AddRepo.
func (r *Repo) Commit(branch, title string, files map[string]Content) string {
	if !refRE.MatchString(branch) || commitRE.MatchString(branch) {
		panic(fmt.Sprintf("hubtest: branch name %q", branch))
	}
	c := &commit{title: title, files: make(map[string]*file, len(files)), dirs: make(map[string]string)}
	for p, content := range files {
		if !validPath(p) {
			panic(fmt.Sprintf("hubtest: file path %q", p))
		}
		f, err := newFile(p, content)
		if err != nil {
			panic(fmt.Sprintf("hubtest: %s: %v", p, err))
		}
		c.files[p] = f
		c.paths = append(c.paths, p)
	}
	slices.Sort(c.paths)
	for _, p := range c.paths {
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			if _, ok := c.files[d]; ok {
				panic(fmt.Sprintf("hubtest: %q is both a file and a directory", d))
			}
		}
	}

	h := r.hub
	h.mu.Lock()
	defer h.mu.Unlock()
	// A git-like id: the hash of the parent, the title and the tree.
	sum := sha1.New()
	fmt.Fprintf(sum, "repo %s\nparent %s\ntitle %s\n", r.id, r.last, title)
	for _, p := range c.paths {
		fmt.Fprintf(sum, "%s %s\n", c.files[p].gitOID, p)
	}
	c.sha = hex.EncodeToString(sum.Sum(nil))
	c.time = time.Now().UTC()
	for _, p := range c.paths {
		for d := path.Dir(p); d != "."; d = path.Dir(d) {
			if _, ok := c.dirs[d]; !ok {
				c.dirs[d] = gitOID("tree", []byte(c.sha+"/"+d))
			}
		}
	}
	r.commits[c.sha] = c
	r.refs[branch] = c.sha
	r.last = c.sha
	for _, f := range c.files {
		if f.lfs {
			h.blobs[f.sha256] = f.content
		}
		if cl, ok := f.content.(io.Closer); ok {
			h.closers = append(h.closers, cl)
		}
	}
	return c.sha
}

// Branch points branch name at commit, creating it or moving it.
func (r *Repo) Branch(name, commit string) { r.setRef(name, commit) }

// Tag points tag name at commit.
func (r *Repo) Tag(name, commit string) { r.setRef(name, commit) }

func (r *Repo) setRef(name, commit string) {
	if !refRE.MatchString(name) || commitRE.MatchString(name) {
		panic(fmt.Sprintf("hubtest: ref name %q", name))
	}
	r.hub.mu.Lock()
	defer r.hub.mu.Unlock()
	if _, ok := r.commits[commit]; !ok {
		panic(fmt.Sprintf("hubtest: %s has no commit %q", r.id, commit))
	}
	r.refs[name] = commit
}

// Resolve returns the commit a branch, tag or commit names, or "".
func (r *Repo) Resolve(revision string) string {
	r.hub.mu.Lock()
	defer r.hub.mu.Unlock()
	if c := r.commitLocked(revision); c != nil {
		return c.sha
	}
	return ""
}

func (r *Repo) commitLocked(rev string) *commit {
	if c, ok := r.commits[rev]; ok {
		return c
	}
	if sha, ok := r.refs[rev]; ok {
		return r.commits[sha]
	}
	return nil
}

func validPath(p string) bool {
	if p == "" || len(p) > 1024 || strings.ContainsAny(p, "\x00\\") {
		return false
	}
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return false
		}
	}
	return true
}

// lfsPatterns are file name suffixes the hub's default .gitattributes
// stores with LFS.
var lfsPatterns = []string{
	".7z", ".arrow", ".bin", ".bz2", ".ckpt", ".ftz", ".gguf", ".gz", ".h5", ".joblib",
	".mlmodel", ".model", ".msgpack", ".npy", ".npz", ".onnx", ".ot", ".parquet", ".pb",
	".pickle", ".pkl", ".pt", ".pth", ".rar", ".safetensors", ".tar", ".tflite", ".tgz",
	".wasm", ".xz", ".zip", ".zst",
}

// lfsThreshold is the size from which the hub requires LFS.
const lfsThreshold = 10 << 20

func newFile(p string, c Content) (*file, error) {
	storage := Auto
	if s, ok := c.(stored); ok {
		storage, c = s.storage, s.Content
	}
	f := &file{path: p, content: c, size: c.Size()}
	switch storage {
	case Git:
	case LFS:
		f.lfs = true
	default:
		f.lfs = f.size >= lfsThreshold || strings.Contains(path.Base(p), "tfevents")
		for _, s := range lfsPatterns {
			if strings.HasSuffix(p, s) {
				f.lfs = true
			}
		}
	}
	sha := sha256.New()
	blob := sha1.New()
	fmt.Fprintf(blob, "blob %d\x00", f.size)
	w := io.Writer(sha)
	if !f.lfs {
		w = io.MultiWriter(sha, blob)
	}
	if _, err := io.Copy(w, io.NewSectionReader(c, 0, f.size)); err != nil {
		return nil, err
	}
	f.sha256 = hex.EncodeToString(sha.Sum(nil))
	if f.lfs {
		ptr := lfsPointer(f.sha256, f.size)
		f.pointer = len(ptr)
		f.gitOID = gitOID("blob", ptr)
	} else {
		f.gitOID = hex.EncodeToString(blob.Sum(nil))
	}
	return f, nil
}

// lfsPointer is the Git LFS pointer file committed in place of the content.
func lfsPointer(sha256hex string, size int64) []byte {
	return []byte("version https://git-lfs.github.com/spec/v1\noid sha256:" + sha256hex + "\nsize " + strconv.FormatInt(size, 10) + "\n")
}

// gitOID is git's object id of an object of kind with data.
func gitOID(kind string, data []byte) string {
	h := sha1.New()
	fmt.Fprintf(h, "%s %d\x00", kind, len(data))
	h.Write(data)
	return hex.EncodeToString(h.Sum(nil))
}

// sign returns the signature of a CDN path valid until expires.
func (h *Hub) sign(p string, expires int64) string {
	m := hmac.New(sha256.New, h.secret)
	fmt.Fprintf(m, "%s\n%d", p, expires)
	return hex.EncodeToString(m.Sum(nil))
}
