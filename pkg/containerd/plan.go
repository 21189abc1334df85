package containerd

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/url"
	"os"
	"slices"
	"strings"

	"github.com/containerd/containerd/v2/core/images"
	"github.com/containerd/containerd/v2/pkg/labels"
	"github.com/containerd/platforms"
	"github.com/distribution/reference"
	"github.com/opencontainers/go-digest"
	ocispec "github.com/opencontainers/image-spec/specs-go/v1"

	"github.com/weightd/weightd/pkg/content"
	"github.com/weightd/weightd/pkg/source"
)

// maxManifestSize bounds the index, manifest and config blobs read into
// memory (containerd's own limit for manifests is 4 MiB).
const maxManifestSize = 8 << 20

// plan is an image checked and worked out for import. It is built in two
// steps: newPlan checks what the image's description says (its name, its
// blobs, its target); layout then reads the index, manifest and config from
// the cache as they become available and works out the layers to unpack and
// the labels containerd's GC needs. A plan is not safe for concurrent use.
type plan struct {
	name    string // the normalised reference: the image record's name
	named   reference.Named
	records []string // name, then the repository digest and the ID records the CRI keeps
	target  ocispec.Descriptor
	// blobs are the image's distinct blobs in the order the image lists
	// them.
	blobs    []*planBlob
	byDigest map[digest.Digest]*planBlob

	platform     platforms.MatchComparer
	platformName string

	// Set by layout as the documents are read.
	index    *planBlob   // the target, if an index
	manifest *planBlob   // the manifest for the platform
	config   *planBlob   // its config
	layers   []*planBlob // the manifest's layers, base first
	diffIDs  []digest.Digest
	ready    bool // layout is complete
}

type planBlob struct {
	desc   ocispec.Descriptor
	file   *os.File          // nil until opened
	labels map[string]string // GC references and distribution source
	// parent is a manifest or an index: written after the blobs it
	// references, once its labels are known.
	parent bool
}

func (p *plan) close() {
	for _, b := range p.blobs {
		if b.file != nil {
			b.file.Close()
			b.file = nil
		}
	}
}

// errInvalidImage marks an image that no retry can import; it is wrapped
// with content.Permanent.
var errInvalidImage = errors.New("invalid image")

func invalid(format string, args ...any) error {
	return content.Permanent(fmt.Errorf("%w: "+format, append([]any{errInvalidImage}, args...)...))
}

// newPlan checks what img says of itself, reading nothing from the cache.
func newPlan(img *source.Image, platform platforms.MatchComparer, platformName string) (*plan, error) {
	if img == nil {
		return nil, invalid("no image")
	}
	named, err := reference.ParseNormalizedNamed(img.Name)
	if err != nil {
		return nil, invalid("image name %q: %v", img.Name, err)
	}
	named = reference.TagNameOnly(named) // "busybox" is busybox:latest, as for a pull
	p := &plan{
		name:         named.String(),
		named:        named,
		byDigest:     make(map[digest.Digest]*planBlob, len(img.Blobs)),
		platform:     platform,
		platformName: platformName,
	}
	distKey, distRepo := distributionSource(named)
	for _, b := range img.Blobs {
		if err := b.Validate(); err != nil {
			return nil, invalid("image %s: blob %s: %v", p.name, b.Digest, err)
		}
		if b.MediaType == "" {
			return nil, invalid("image %s: blob %s has no media type", p.name, b.Digest)
		}
		if prev, ok := p.byDigest[b.Digest]; ok {
			if prev.desc.Size != b.Size {
				return nil, invalid("image %s: blob %s listed with sizes %d and %d", p.name, b.Digest, prev.desc.Size, b.Size)
			}
			continue
		}
		pb := &planBlob{
			desc:   ocispec.Descriptor{MediaType: b.MediaType, Digest: b.Digest, Size: b.Size},
			labels: map[string]string{},
			parent: images.IsIndexType(b.MediaType) || images.IsManifestType(b.MediaType),
		}
		if distKey != "" {
			pb.labels[distKey] = distRepo
		}
		p.byDigest[b.Digest] = pb
		p.blobs = append(p.blobs, pb)
	}
	t, ok := p.byDigest[img.Target.Digest]
	if err := img.Target.Validate(); err != nil || !ok || t.desc.Size != img.Target.Size {
		return nil, invalid("image %s: target %s is not among its blobs", p.name, img.Target.Digest)
	}
	if img.Target.MediaType != "" && img.Target.MediaType != t.desc.MediaType {
		return nil, invalid("image %s: target %s is %s, its blob %s", p.name, img.Target.Digest, img.Target.MediaType, t.desc.MediaType)
	}
	if !t.parent {
		return nil, invalid("image %s: target %s has media type %q, neither an index nor a manifest", p.name, t.desc.Digest, t.desc.MediaType)
	}
	p.target = t.desc
	if dn, ok := named.(reference.Digested); ok && dn.Digest() != p.target.Digest {
		return nil, invalid("image %s: the name's digest is not the target's, %s", p.name, p.target.Digest)
	}
	return p, nil
}

// open opens b in the cache and checks its size.
func (p *plan) open(b *planBlob, blobs BlobOpener) error {
	if b.file != nil {
		return nil
	}
	f, err := blobs.Open(b.desc.Digest)
	if err != nil {
		return fmt.Errorf("image %s: blob %s is not in the cache: %w", p.name, b.desc.Digest, err)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fmt.Errorf("image %s: blob %s in the cache: %w", p.name, b.desc.Digest, err)
	}
	if fi.Size() != b.desc.Size {
		f.Close()
		return fmt.Errorf("image %s: blob %s is %d bytes in the cache, not %d: %w", p.name, b.desc.Digest, fi.Size(), b.desc.Size, content.ErrSizeMismatch)
	}
	b.file = f
	return nil
}

// openAll opens every blob not yet open: a blob missing from the cache
// fails before anything is written to containerd.
func (p *plan) openAll(blobs BlobOpener) error {
	for _, b := range p.blobs {
		if err := p.open(b, blobs); err != nil {
			return err
		}
	}
	return nil
}

// layout reads the index, the manifest and the config as far as they are
// open, and reports whether it is complete: the layers, their diff IDs and
// every label known. It may be called again after more blobs are open.
func (p *plan) layout() (bool, error) {
	if p.ready {
		return true, nil
	}
	t := p.byDigest[p.target.Digest]
	if p.manifest == nil {
		if t.file == nil {
			return false, nil
		}
		if !images.IsIndexType(t.desc.MediaType) {
			p.manifest = t
		} else if err := p.chooseManifest(t); err != nil {
			return false, err
		}
	}
	if p.config == nil {
		if p.manifest.file == nil {
			return false, nil
		}
		if err := p.readManifest(); err != nil {
			return false, err
		}
	}
	if p.config.file == nil {
		return false, nil
	}
	if err := p.readConfig(); err != nil {
		return false, err
	}
	p.ready = true
	return true, nil
}

// chooseManifest reads the index t and picks the manifest containerd will
// pick for the platform (as images.Manifest does): the best match among the
// index's.
func (p *plan) chooseManifest(t *planBlob) error {
	p.index = t
	var idx ocispec.Index
	if err := readJSON(t, &idx); err != nil {
		return invalid("image %s: index %s: %v", p.name, t.desc.Digest, err)
	}
	var matching []ocispec.Descriptor
	for _, m := range idx.Manifests {
		if images.IsManifestType(m.MediaType) && (m.Platform == nil || p.platform.Match(*m.Platform)) {
			matching = append(matching, m)
		}
	}
	slices.SortStableFunc(matching, func(a, b ocispec.Descriptor) int {
		switch {
		case a.Platform == nil && b.Platform == nil:
			return 0
		case a.Platform == nil:
			return 1
		case b.Platform == nil:
			return -1
		case p.platform.Less(*a.Platform, *b.Platform):
			return -1
		case p.platform.Less(*b.Platform, *a.Platform):
			return 1
		}
		return 0
	})
	if len(matching) == 0 {
		return invalid("image %s: index %s has no manifest for %s", p.name, t.desc.Digest, p.platformName)
	}
	m, ok := p.byDigest[matching[0].Digest]
	if !ok || m.desc.Size != matching[0].Size {
		return invalid("image %s: the manifest for %s, %s, is not among its blobs", p.name, p.platformName, matching[0].Digest)
	}
	p.manifest = m
	// Reference the manifests present, as containerd does for the manifests
	// of an index it pulled for one platform.
	var present []ocispec.Descriptor
	for _, c := range idx.Manifests {
		if b, ok := p.byDigest[c.Digest]; ok && b.desc.Size == c.Size {
			present = append(present, c)
		}
	}
	maps.Copy(t.labels, childLabels(present))
	return nil
}

// readManifest reads the manifest, checks its children are among the
// image's blobs and works out its labels and the image's records.
func (p *plan) readManifest() error {
	manifest := p.manifest
	var m ocispec.Manifest
	if err := readJSON(manifest, &m); err != nil {
		return invalid("image %s: manifest %s: %v", p.name, manifest.desc.Digest, err)
	}
	children := append([]ocispec.Descriptor{m.Config}, m.Layers...)
	for _, c := range children {
		b, ok := p.byDigest[c.Digest]
		if !ok || b.desc.Size != c.Size {
			return invalid("image %s: manifest %s lists %s of %d bytes, which is not among its blobs", p.name, manifest.desc.Digest, c.Digest, c.Size)
		}
	}
	if b := p.byDigest[m.Config.Digest]; b.parent {
		return invalid("image %s: manifest %s has config %s of media type %q", p.name, manifest.desc.Digest, m.Config.Digest, b.desc.MediaType)
	}
	for _, l := range m.Layers {
		b := p.byDigest[l.Digest]
		if b.parent {
			return invalid("image %s: manifest %s has layer %s of media type %q", p.name, manifest.desc.Digest, l.Digest, b.desc.MediaType)
		}
		p.layers = append(p.layers, b)
	}
	maps.Copy(manifest.labels, childLabels(children))

	p.records = []string{p.name}
	if _, tagged := p.named.(reference.Tagged); tagged {
		if rd, err := reference.WithDigest(reference.TrimNamed(p.named), p.target.Digest); err == nil {
			p.records = append(p.records, rd.String())
		}
	}
	p.records = append(p.records, m.Config.Digest.String())
	p.config = p.byDigest[m.Config.Digest]
	return nil
}

// readConfig reads the config: its platform, for a lone manifest, and the
// layers' diff IDs.
func (p *plan) readConfig() error {
	var cfg ocispec.Image
	if err := readJSON(p.config, &cfg); err != nil {
		return invalid("image %s: config %s: %v", p.name, p.config.desc.Digest, err)
	}
	if p.index == nil {
		// A lone manifest: containerd checks its config's platform.
		cp := platforms.Normalize(ocispec.Platform{OS: cfg.OS, Architecture: cfg.Architecture, Variant: cfg.Variant})
		if !p.platform.Match(cp) {
			return invalid("image %s is for %s, not %s", p.name, platforms.Format(cp), p.platformName)
		}
	}
	if len(cfg.RootFS.DiffIDs) != len(p.layers) {
		return invalid("image %s: config %s has %d diff IDs for %d layers", p.name, p.config.desc.Digest, len(cfg.RootFS.DiffIDs), len(p.layers))
	}
	for _, d := range cfg.RootFS.DiffIDs {
		if err := d.Validate(); err != nil {
			return invalid("image %s: config %s: diff ID %q: %v", p.name, p.config.desc.Digest, d, err)
		}
	}
	p.diffIDs = cfg.RootFS.DiffIDs
	return nil
}

// parents are the manifests and the index in the order they are written:
// the manifests, then the index, each after what it references.
func (p *plan) parents() []*planBlob {
	var out []*planBlob
	for _, b := range p.blobs {
		if b.parent && b != p.index {
			out = append(out, b)
		}
	}
	for _, b := range p.blobs {
		if b.parent && b == p.index {
			out = append(out, b)
		}
	}
	return out
}

// childLabels are the containerd.io/gc.ref.content.* labels that make a
// parent blob keep its children, numbered as containerd numbers them.
func childLabels(children []ocispec.Descriptor) map[string]string {
	out := make(map[string]string, len(children))
	seen := map[string]int{}
	for _, c := range children {
		for _, key := range images.ChildGCLabels(c) {
			i := seen[key]
			seen[key] = i + 1
			if strings.HasSuffix(key, ".sha256.") { // referrers: keyed by digest
				key += c.Digest.Encoded()[:min(12, len(c.Digest.Encoded()))]
			} else if i > 0 || strings.HasSuffix(key, ".") {
				key = fmt.Sprintf("%s%d", key, i)
			}
			out[key] = c.Digest.String()
		}
	}
	return out
}

// distributionSource is the containerd.io/distribution.source.<host> label
// containerd puts on what it pulls from host's repository (the host without
// its port, as containerd does), or "" if it would not be a valid label.
func distributionSource(named reference.Named) (key, repo string) {
	u, err := url.Parse("dummy://" + reference.Domain(named))
	if err != nil || u.Hostname() == "" {
		return "", ""
	}
	key, repo = labels.LabelDistributionSource+"."+u.Hostname(), reference.Path(named)
	if labels.Validate(key, repo) != nil {
		return "", ""
	}
	return key, repo
}

func readJSON(b *planBlob, v any) error {
	if b.desc.Size > maxManifestSize {
		return fmt.Errorf("%d bytes, more than the %d allowed", b.desc.Size, maxManifestSize)
	}
	data, err := io.ReadAll(io.NewSectionReader(b.file, 0, b.desc.Size))
	if err != nil {
		return err
	}
	return json.Unmarshal(data, v)
}
