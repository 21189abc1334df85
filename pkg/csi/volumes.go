package csi

import (
	"cmp"
	"path/filepath"
	"slices"
)

// Volume is a published volume, for `weightd status`: what holds which
// blobs of the cache while pods use them.
type Volume struct {
	ID     string
	Target string
	// Namespace and Pod are the pod's, where the kubelet told them
	// (podInfoOnMount); PodUID comes from the target path.
	Namespace, Pod, PodUID string
	// Name is the pod's volume name (a persistent volume's name for a
	// PersistentVolumeClaim).
	Name  string
	Ref   string
	Blobs int
	Bytes int64 // of its blobs the cache holds
}

// Volumes lists the published volumes from their records, ordered by pod;
// err names the records that could not be read, beside those that could.
func (d *Driver) Volumes() ([]Volume, error) {
	recs, err := d.records()
	vols := make([]Volume, 0, len(recs))
	for _, rec := range recs {
		v := Volume{ID: rec.VolumeID, Target: rec.Target, Namespace: rec.Namespace, Pod: rec.Pod,
			PodUID: podUID(rec.Target), Name: volumeName(rec.Target), Ref: rec.Ref, Blobs: len(rec.Blobs)}
		for _, b := range rec.Blobs {
			if info, err := d.store.Stat(b); err == nil {
				v.Bytes += info.Size
			}
		}
		vols = append(vols, v)
	}
	slices.SortFunc(vols, func(a, b Volume) int {
		return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Pod, b.Pod),
			cmp.Compare(a.PodUID, b.PodUID), cmp.Compare(a.Name, b.Name), cmp.Compare(a.Target, b.Target))
	})
	return vols, err
}

// podUID is the pod's UID in a kubelet target path
// (…/pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount), or "".
func podUID(target string) string {
	if volumeName(target) == "" {
		return ""
	}
	volumes := filepath.Dir(filepath.Dir(filepath.Dir(filepath.Clean(target))))
	if filepath.Base(volumes) != "volumes" || filepath.Base(filepath.Dir(filepath.Dir(volumes))) != "pods" {
		return ""
	}
	return filepath.Base(filepath.Dir(volumes))
}
