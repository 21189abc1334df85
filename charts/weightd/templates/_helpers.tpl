{{/* The chart's name, for labels. */}}
{{- define "weightd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The prefix of every object's name: the release name, with the chart's name
appended unless it is in it already. Kept short enough for the longest
suffix (-scheduler-extender).
*/}}
{{- define "weightd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "weightd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels of every object: (dict "ctx" $ "component" "agent"). helm.sh/chart,
app.kubernetes.io/version and app.kubernetes.io/managed-by are left out of
deploy/ when `make manifests` renders it.
*/}}
{{- define "weightd.labels" -}}
helm.sh/chart: {{ include "weightd.chart" .ctx }}
{{ include "weightd.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
{{- end -}}

{{/* Labels that select a component's pods: (dict "ctx" $ "component" "agent"). */}}
{{- define "weightd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightd.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* The weightd image. */}}
{{- define "weightd.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion | toString) -}}
{{- end -}}
{{- end -}}

{{/* containerd's root without a trailing slash. */}}
{{- define "weightd.containerdRoot" -}}
{{- if eq .Values.containerd.root "/" -}}/{{- else -}}{{- trimSuffix "/" .Values.containerd.root -}}{{- end -}}
{{- end -}}

{{/* The agent's cache root: inside containerd's root, on its mount. */}}
{{- define "weightd.cacheRoot" -}}
{{- printf "%s/weightd" (include "weightd.containerdRoot" . | trimSuffix "/") -}}
{{- end -}}

{{/* Where adapters are staged for warm servers. */}}
{{- define "weightd.stageDir" -}}
{{- .Values.warm.stageDir | default (printf "%s/adapters" (include "weightd.cacheRoot" .)) | trimSuffix "/" -}}
{{- end -}}

{{- define "weightd.gossipSecretName" -}}
{{- .Values.gossip.existingSecret | default (printf "%s-gossip" (include "weightd.fullname" .)) -}}
{{- end -}}

{{- define "weightd.peerCASecretName" -}}
{{- .Values.peerTLS.existingSecret | default (printf "%s-peer-ca" (include "weightd.fullname" .)) -}}
{{- end -}}

{{/* The agent's local API socket. */}}
{{- define "weightd.api" -}}
{{- printf "unix://%s/weightd.sock" (trimSuffix "/" .Values.agent.runDir) -}}
{{- end -}}

{{/* The agent's service account, and the user name its pods' tokens carry. */}}
{{- define "weightd.agentServiceAccount" -}}
{{- include "weightd.fullname" . -}}
{{- end -}}

{{/* Where kube-scheduler calls the extender. */}}
{{- define "weightd.extenderURL" -}}
{{- printf "http://%s-extender.%s.svc:%d" (include "weightd.fullname" .) .Release.Namespace (int .Values.extender.port) -}}
{{- end -}}

{{/* The extender entry of a KubeSchedulerConfiguration. */}}
{{- define "weightd.schedulerExtender" -}}
extenders:
  - urlPrefix: {{ include "weightd.extenderURL" . }}
    # Scores 0..10 × weight × 10 add to the plugins' scores (each 0..100 ×
    # its weight; the default plugins weigh 1 to 3): weight 5 lets a node
    # holding the pod's models win over a node that is merely emptier, not
    # over a node the required rules refuse.
    prioritizeVerb: prioritize
    weight: {{ .Values.extender.weight }}
    # Removes nodes only for pods annotated weightd.io/require-warm: "true".
    filterVerb: filter
    # Send node names only; the extender reads node state from its own
    # informer (a call for 1,000 nodes is ~20 KB instead of megabytes).
    nodeCacheCapable: true
    # Never block scheduling on the extender.
    ignorable: true
    httpTimeout: 2s
    enableHTTPS: false
{{- end -}}

{{/* The kubelet's root directory without a trailing slash. */}}
{{- define "weightd.kubeletDir" -}}
{{- if eq .Values.csi.kubeletDir "/" -}}/{{- else -}}{{- trimSuffix "/" .Values.csi.kubeletDir -}}{{- end -}}
{{- end -}}

{{/*
The CSI driver's name: what pods write in their csi volumes, and the
kubelet's directory of the plugin's socket.
*/}}
{{- define "weightd.csiDriver" -}}models.weightd.io{{- end -}}
